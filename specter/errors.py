"""User-facing error type: one clear line, raised for bad input and missing assets."""


class SpecterError(ValueError):
    """An error caused by the user's input or environment, printed as one line by entry points."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message ("" if it has none): what a one-line error quotes."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
