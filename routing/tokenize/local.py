"""``LocalTokenizer``: the model's own tokenizer and chat template, loaded from its files.

It reproduces what vLLM does with a request: chat messages are rendered with the chat template
and the text tokenized *without* adding special tokens (the template writes BOS itself);
completion prompts are tokenized *with* them. Equal token ids mean equal block hashes, so the
router sees exactly the prefix the engine will cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from routing.contracts import TokenizedPrompt
from routing.tokenize.chat_template import ChatTemplate
from routing.tokenize.errors import TokenizationError
from routing.tokenize.messages import normalise_messages

__all__ = ["LocalTokenizer"]

#: Special-token names a template may reference, as ``tokenizer_config.json`` spells them.
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)
#: Prompts longer than this (characters) are encoded in a worker thread: the Rust encoder needs
#: about a millisecond per few thousand tokens, too long to hold the event loop.
_OFFLOAD_CHARS = 8192


class LocalTokenizer:
    """Tokenizes like vLLM for one model, from a directory holding ``tokenizer.json``.

    The chat template is, in order of precedence: the ``chat_template`` argument (like vLLM's
    ``--chat-template``), ``chat_template.jinja`` in ``model_dir``, or ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is
    used). Without one, chat requests raise ``TokenizationError`` (or the constructor raises
    ``ValueError`` if ``require_chat_template`` is set).

    ``model`` arguments are not checked: one instance serves one model (and its adapters).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        chat_template: str | None = None,
        require_chat_template: bool = False,
    ) -> None:
        directory = Path(model_dir)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"LocalTokenizer: {tokenizer_file} does not exist")
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises plain Exception on bad files
            raise ValueError(f"LocalTokenizer: cannot load {tokenizer_file}: {exc}") from exc
        config = _read_config(directory / "tokenizer_config.json")
        source = chat_template or _template_source(directory, config)
        special = {key: token for key in _SPECIAL_TOKEN_KEYS if (token := _token(config, key))}
        self.chat_template = ChatTemplate(source, special) if source else None
        if self.chat_template is None and require_chat_template:
            raise ValueError(f"LocalTokenizer: no chat template found in {directory}")
        self.model_dir = directory

    async def tokenize_completion(self, model: str, prompt: str) -> TokenizedPrompt:
        """Token ids of a completion prompt, special tokens (e.g. BOS) added as vLLM does."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string (got {type(prompt).__name__})")
        return TokenizedPrompt(token_ids=await self._encode(prompt, add_special_tokens=True))

    async def tokenize_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> TokenizedPrompt:
        """Render the chat template over ``messages`` and tokenize without special tokens.

        ``add_generation_prompt`` defaults to ``True`` (vLLM's default); other keyword arguments
        (``tools``, ``documents``, ``chat_template_kwargs`` contents) reach the template.
        """
        text = self.render_chat(messages, **template_kwargs)
        return TokenizedPrompt(token_ids=await self._encode(text, add_special_tokens=False))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any) -> str:
        """The prompt text the chat template makes of ``messages``."""
        if self.chat_template is None:
            raise TokenizationError(
                f"LocalTokenizer: {self.model_dir} has no chat template; pass chat_template="
            )
        add_generation_prompt = bool(template_kwargs.pop("add_generation_prompt", True))
        normalised = normalise_messages(messages)
        text = self.chat_template.render(
            normalised, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        if template_kwargs.get("continue_final_message"):
            return _open_final_message(text, normalised)
        return text

    async def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if len(text) > _OFFLOAD_CHARS:
            encoding = await asyncio.to_thread(
                self._tokenizer.encode, text, add_special_tokens=add_special_tokens
            )
        else:
            encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(encoding.ids)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"LocalTokenizer: cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"LocalTokenizer: {path} must hold a JSON object")
    return config


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        # Several named templates (e.g. "default", "tool_use"): vLLM uses "default".
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, Mapping)
        }
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(
        "LocalTokenizer: tokenizer_config.json chat_template must be a string or a list "
        "holding a template named 'default'"
    )


def _token(config: Mapping[str, Any], key: str) -> str | None:
    """A special token's text; configs store either the string or an AddedToken object."""
    value = config.get(key)
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` cut right after the final message's content, as transformers does for
    ``continue_final_message``: the model goes on with that message instead of a new turn."""
    final = (messages[-1].get("content") or "").strip() if messages else ""
    if not final or final not in text:
        raise TokenizationError(
            "continue_final_message: the chat template does not render the final message's text"
        )
    return text[: text.rindex(final) + len(final)]
