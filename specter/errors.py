"""User-facing error type: one clear line, raised for bad input and missing assets."""


class SpecterError(ValueError):
    """An error caused by the user's input or environment, printed as one line by entry points."""
