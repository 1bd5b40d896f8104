"""``build_tokenizer``: one place that turns configuration into a ``PromptTokenizer``."""

from __future__ import annotations

from typing import Any, Literal

from routing.contracts import PromptTokenizer
from routing.tokenize.local import LocalTokenizer
from routing.tokenize.remote import RemoteTokenizer
from routing.tokenize.text import TextTokenizer

__all__ = ["TokenizerKind", "build_tokenizer"]

TokenizerKind = Literal["local", "remote", "text"]


def build_tokenizer(kind: TokenizerKind, **opts: Any) -> PromptTokenizer:
    """Build a tokenizer: ``"local"`` (``model_dir``, ``chat_template``), ``"remote"``
    (``base_url``, ``cache_size``, ``timeout_s``, ...) or ``"text"`` (no options)."""
    if kind == "local":
        if "model_dir" not in opts:
            raise ValueError("tokenizer kind 'local' needs model_dir")
        return LocalTokenizer(**opts)
    if kind == "remote":
        if "base_url" not in opts:
            raise ValueError("tokenizer kind 'remote' needs base_url")
        return RemoteTokenizer(**opts)
    if kind == "text":
        if opts:
            raise ValueError(f"tokenizer kind 'text' takes no options (got {sorted(opts)})")
        return TextTokenizer()
    raise ValueError(f"tokenizer kind must be 'local', 'remote' or 'text' (got {kind!r})")
