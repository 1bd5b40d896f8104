"""Checks and normalisation of OpenAI chat ``messages``, shared by every tokenizer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.tokenize.errors import InvalidMessages

__all__ = ["content_text", "normalise_messages"]


def content_text(content: Any, where: str) -> str | None:
    """Text of a message ``content``: a string, ``None``, or a list of parts.

    Text parts are joined with newlines, which is what vLLM does for templates that expect
    string content; other parts (images, audio) are not text and are skipped here.
    """
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        texts: list[str] = []
        for position, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise InvalidMessages(f"{where}.content[{position}] must be an object with a type")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise InvalidMessages(f"{where}.content[{position}].text must be a string")
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
