"""Checks and normalisation of OpenAI chat ``messages``, shared by every tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.tokenize.errors import InvalidMessages

__all__ = ["TEXT_PART_KEYS", "content_text", "normalise_messages", "text_parts"]


#: vLLM's text part types (``TEXT_PART_TYPES`` of its chat utilities) and the key that holds
#: each one's text. A part of any other type (image, audio, embeddings) is not text.
TEXT_PART_KEYS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def content_text(content: Any, where: str) -> str | None:
    """Text of a message ``content``: a string, ``None``, or a list of parts.

    Text parts are joined with newlines, which is what vLLM does for templates that expect
    string content. As in vLLM, a part may be a plain string, and a text part whose text is
    missing or null is skipped; other parts (images, audio, a part with no type but a media
    URL) are not text and are skipped here, for the engine to judge.
    """
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        return "\n".join(text_parts(content, where))
    raise InvalidMessages(
        f"{where}.content must be a string, null or a list of parts (got {type(content).__name__})"
    )


def text_parts(parts: Sequence[Any], where: str = "", strict: bool = True) -> list[str]:
    """The texts of a list of content parts, as vLLM reads them: plain strings, and the text of
    each text-typed part (``TEXT_PART_KEYS``) whose text is not null. ``strict``: a part that is
    neither a string nor an object, or a text that is not a string, is ``InvalidMessages``
    (naming it under ``where``); else it is skipped."""
    texts: list[str] = []
    for position, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            if strict:
                raise InvalidMessages(
                    f"{where}.content[{position}] must be a string or an object "
                    f"(got {type(part).__name__})"
                )
            continue
        kind = part.get("type")
        key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        text = part.get(key) if key is not None else None
        if text is None:
            continue
        if not isinstance(text, str):
            if strict:
                raise InvalidMessages(f"{where}.content[{position}].{key} must be a string")
            continue
        texts.append(text)
    return texts


def normalise_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated copies of ``messages`` with list-of-parts content flattened to text."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidMessages(f"messages must be a list (got {type(messages).__name__})")
    if not messages:
        raise InvalidMessages("messages must not be empty")
    normalised: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, Mapping):
            raise InvalidMessages(f"{where} must be an object (got {type(message).__name__})")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidMessages(f"{where}.role must be a non-empty string (got {role!r})")
        copy = dict(message)
        copy["content"] = content_text(message.get("content"), where)
        normalised.append(copy)
    return normalised
