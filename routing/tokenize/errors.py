"""Errors of the tokenization front."""

from __future__ import annotations


class TokenizationError(RuntimeError):
    """A prompt could not be tokenized (bad template, upstream ``/tokenize`` failed, ...).

    The gateway can fall back to text mode or to load-only routing; the request itself is not
    lost because of it.
    """


class InvalidMessages(ValueError):
    """Chat ``messages`` are not a list of ``{"role": str, "content": ...}`` objects."""
