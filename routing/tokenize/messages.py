"""Checks and normalisation of OpenAI chat ``messages``, shared by every tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.tokenize.errors import InvalidMessages

__all__ = ["content_text", "normalise_messages"]


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
        texts: list[str] = []
        for position, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise InvalidMessages(
                    f"{where}.content[{position}] must be a string or an object "
                    f"(got {type(part).__name__})"
                )
            kind = part.get("type")
            key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
            if key is None:
                continue
            text = part.get(key)
            if text is None:
                continue
            if not isinstance(text, str):
                raise InvalidMessages(f"{where}.content[{position}].{key} must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise InvalidMessages(
        f"{where}.content must be a string, null or a list of parts (got {type(content).__name__})"
    )


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
