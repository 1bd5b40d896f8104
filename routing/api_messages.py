"""The chat messages vLLM builds from a Responses or an Anthropic Messages request.

vLLM serves ``POST /v1/responses`` and ``POST /v1/messages`` by turning the body into chat
messages and rendering them through the model's chat template, exactly as for
``/v1/chat/completions``. The gateway needs the same messages to tokenize and hash the prompt for
prefix-aware routing, and the simulated replica needs them to build the prompt it "prefills". Both
use these functions, so the gateway hashes the token ids the engine caches.

Mirrors vLLM 0.32 ``entrypoints/openai/responses/utils.py::construct_input_messages`` and
``entrypoints/anthropic/serving.py::to_chat_completion_request`` for text, tool calls and tool
results; images become ``image_url`` parts as vLLM makes them (they do not count toward the text
the gateway hashes). Malformed shapes raise ``ValueError`` with the path of the offending field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]

#: Claude Code prefixes its system prompt with a per-request billing header; vLLM drops it
#: ("it defeats prefix caching"), and so must the gateway to hash what the engine caches.
_BILLING_HEADER = "x-anthropic-billing-header"

#: Responses content-part types that carry text (the user's, or a previous answer's).
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


# --------------------------------------------------------------------------- Responses API


def responses_messages(
    body: Mapping[str, Any],
    previous_messages: Sequence[Mapping[str, Any]] | None = None,
    previous_output_texts: Sequence[str] = (),
) -> list[Message]:
    """``instructions`` + (a previous response's conversation) + ``input`` as chat messages.

    ``previous_messages``: the stored input messages of the response named by
    ``previous_response_id`` (their system message is dropped: instructions do not carry over);
    ``previous_output_texts``: that response's output message texts, replayed as assistant turns.
    """
    messages: list[Message] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError("instructions: must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous_messages:
        messages.extend(dict(m) for m in previous_messages if m.get("role") != "system")
    messages.extend({"role": "assistant", "content": text} for text in previous_output_texts)
    request_input = body.get("input")
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
    elif isinstance(request_input, list) and request_input:
        for i, item in enumerate(request_input):
            _append_response_item(messages, item, f"input[{i}]")
    else:
        raise ValueError("input: must be a string or a non-empty array of input items")
    return messages


def _append_response_item(messages: list[Message], item: Any, path: str) -> None:
    """One input item as vLLM converts it (tool calls merge into the previous assistant turn)."""
    if not isinstance(item, Mapping):
        raise ValueError(f"{path}: must be an object")
    item_type = item.get("type")
    last_assistant = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if item_type in ("function_call", "custom_tool_call"):
        arguments = item.get("arguments") if item_type == "function_call" else item.get("input")
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": arguments or ""},
        }
        if last_assistant is not None and isinstance(last_assistant.get("tool_calls"), list):
            last_assistant["tool_calls"].append(call)
        elif last_assistant is not None and "tool_calls" not in last_assistant:
            last_assistant["tool_calls"] = [call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return
    if item_type in ("function_call_output", "custom_tool_call_output"):
        messages.append(
            {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
        )
        return
    if item_type == "reasoning":
        texts = item.get("content") or item.get("summary") or []
        if not isinstance(texts, list):
            raise ValueError(f"{path}: a reasoning item's content and summary must be arrays")
        reasoning = texts[0].get("text", "") if texts and isinstance(texts[0], Mapping) else ""
        if last_assistant is not None and last_assistant.get("reasoning") is None:
            last_assistant["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "reasoning": reasoning})
        return
    role = item.get("role")
    if not isinstance(role, str):
        raise ValueError(f"{path}: unsupported input item type {item_type!r} (no 'role')")
    content = item.get("content")
    if role == "assistant":
        # vLLM keeps only the first part of an assistant message (a previous answer's text).
        text = content if isinstance(content, str) else _first_text(content)
        if last_assistant is not None and last_assistant.get("content") is None:
            last_assistant["content"] = text
        else:
            messages.append({"role": "assistant", "content": text})
        return
    messages.append({"role": role, "content": _response_content(content, f"{path}.content")})


def _first_text(content: Any) -> str:
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        return str(content[0].get("text") or "")
    return ""


def _response_content(content: Any, path: str) -> str | list[Message]:
    """A message's content: a string stays; text parts become chat ``text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{path}: must be a string or an array of content parts")
    parts: list[Message] = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValueError(f"{path}[{i}]: must be an object")
        if part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        elif part.get("type") == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


# --------------------------------------------------------------------------- Anthropic Messages


def anthropic_messages(body: Mapping[str, Any]) -> list[Message]:
    """``system`` + ``messages`` of an Anthropic Messages request as chat messages."""
    messages: list[Message] = []
    system = _anthropic_system_text(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    items = body.get("messages")
    if not isinstance(items, list) or not items:
        raise ValueError("messages: must be a non-empty array")
    for i, message in enumerate(items):
        path = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{path}: must be an object")
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise ValueError(f"{path}.role: must be 'user', 'assistant' or 'system' (got {role!r})")
        content = message.get("content")
        if role == "system":
            text = _anthropic_system_text(content, f"{path}.content")
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{path}.content: must be a string or an array of content blocks")
        _append_anthropic_blocks(messages, role, content, f"{path}.content")
    return messages


def _anthropic_system_text(system: Any, path: str) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return "" if system.startswith(_BILLING_HEADER) else system
    if not isinstance(system, list):
        raise ValueError(f"{path}: must be a string or an array of text blocks")
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, Mapping):
            raise ValueError(f"{path}[{i}]: must be an object")
        text = block.get("text")
        if block.get("type") == "text" and text and not str(text).startswith(_BILLING_HEADER):
            parts.append(str(text))
    return "".join(parts)


def _append_anthropic_blocks(
    messages: list[Message], role: str, blocks: list[Any], path: str
) -> None:
    message: Message = {"role": role}
    parts: list[Message] = []
    tool_calls: list[Message] = []
    reasoning: list[str] = []
    for i, block in enumerate(blocks):
        if not isinstance(block, Mapping):
            raise ValueError(f"{path}[{i}]: must be an object")
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": str(block["text"])})
        elif kind == "image" and isinstance(block.get("source"), Mapping):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            tool_calls.append({
                "id": block.get("id"),
                "type": "function",
                "function": {"name": block.get("name"),
                             "arguments": json.dumps(block.get("input") or {})},
            })
        elif kind == "tool_result":
            messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                             "content": _tool_result_text(block.get("content"))})
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        message["content"] = parts[0]["text"] if only_text else parts
    elif not tool_calls and not reasoning:
        return
    messages.append(message)


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(b.get("text") or "") for b in content
            if isinstance(b, Mapping) and b.get("type") == "text"
        )
    return ""


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url") or "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
