"""An OpenAI-compatible HTTP server over one loaded Specter model (`python -m specter serve`; the `serve` extra)."""
