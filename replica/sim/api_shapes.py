"""JSON bodies of vLLM 0.32's Responses, Anthropic Messages and embeddings endpoints.

Kept apart from the handlers (``replica.sim.api_server``) so the shapes can be read next to
vLLM's ``entrypoints/openai/responses/protocol.py`` + ``streaming_events.py``,
``entrypoints/anthropic/{protocol,serving}.py`` and ``entrypoints/pooling/embed/protocol.py``.
Only the text path is modelled: no tools, reasoning or logprobs in the outputs.
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import xxhash

_json = msgspec.json.Encoder()


def sse_event(event: str, payload: Mapping[str, Any]) -> bytes:
    """One named server-sent event (``event:`` then ``data:``), as both APIs stream them."""
    return b"event: " + event.encode() + b"\ndata: " + _json.encode(payload) + b"\n\n"


# --------------------------------------------------------------------------- Responses API


def responses_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage`` (single turn)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [prompt],
                                 "cached_tokens_per_turn": [cached]},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [output],
                                  "tool_output_tokens_per_turn": [0]},
        "total_tokens": prompt + output,
    }


class ResponseShapes:
    """Bodies of one ``/v1/responses`` answer; ``id`` is vLLM's ``request_id`` (``resp_…``)."""

    def __init__(self, body: Mapping[str, Any], model: str, max_output_tokens: int) -> None:
        # vLLM: the response id is the request's ``request_id`` (a client, or the gateway, may set
        # it), else ``resp_`` and a random uuid.
        given = body.get("request_id")
        self.id = given if isinstance(given, str) and given else f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created_at = int(time.time())
        self.body = body
        self.max_output_tokens = max_output_tokens
        self.sequence_number = 0

    def response(
        self, status: str, output_text: str | None, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """``ResponsesResponse`` (``in_progress`` with no output while streaming starts)."""
        body = self.body
        output = []
        if output_text is not None:
            output.append(self._message(output_text, "completed"))
        return {
            "id": self.id,
            "created_at": self.created_at,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature") if body.get("temperature") is not None
            else 1.0,
            "tool_choice": "none",
            "tools": [],
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "background": bool(body.get("background", False)),
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "usage": usage,
            "user": body.get("user"),
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [self._text_part(text)] if text else []
        return {"id": self.message_id, "content": content, "role": "assistant",
                "status": status, "type": "message"}

    @staticmethod
    def _text_part(text: str) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}

    def _event(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return sse_event(event_type, payload)

    def start_events(self) -> list[bytes]:
        """``response.created``, ``response.in_progress``, then the message and its text part."""
        initial = self.response("in_progress", None, None)
        return [
            self._event("response.created", response=initial),
            self._event("response.in_progress", response=initial),
            self._event("response.output_item.added", output_index=0,
                        item={**self._message("", "in_progress"), "content": []}),
            self._event("response.content_part.added", output_index=0, item_id=self.message_id,
                        content_index=0,
                        part={"annotations": [], "text": "", "type": "output_text",
                              "logprobs": []}),
        ]

    def delta_event(self, text: str) -> bytes:
        return self._event("response.output_text.delta", content_index=0, output_index=0,
                           item_id=self.message_id, delta=text, logprobs=[])

    def end_events(self, text: str, status: str, usage: dict[str, Any]) -> list[bytes]:
        """The text, part and item done events, then ``response.completed`` (any final status)."""
        part = self._text_part(text)
        return [
            self._event("response.output_text.done", output_index=0, content_index=0, text=text,
                        logprobs=[], item_id=self.message_id),
            self._event("response.content_part.done", item_id=self.message_id, output_index=0,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=0,
                        item=self._message(text, "completed")),
            self._event("response.completed", response=self.response(status, text, usage)),
        ]


# --------------------------------------------------------------------------- Anthropic Messages


def anthropic_usage(prompt: int, output: int, cached: int | None) -> dict[str, Any]:
    """vLLM's ``_build_anthropic_usage``: ``input_tokens`` excludes the cache-read tokens."""
    usage: dict[str, Any] = {"input_tokens": max(0, prompt - (cached or 0)),
                             "output_tokens": output}
    if cached is not None:
        usage["cache_read_input_tokens"] = cached
    return usage


def anthropic_error(err_type: str, message: str) -> dict[str, Any]:
    """vLLM's ``AnthropicErrorResponse`` (the ``type`` is vLLM's error type name)."""
    return {"type": "error", "error": {"type": err_type, "message": message}}


class MessageShapes:
    """Bodies of one ``/v1/messages`` answer (``id`` is the chat completion's, as in vLLM)."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model

    def full(self, text: str, stop_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        """``AnthropicMessagesResponse`` dumped with ``exclude_none``."""
        return {"id": self.id, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": text}], "model": self.model,
                "stop_reason": stop_reason, "usage": usage}

    def start_events(self, usage: dict[str, Any]) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "content": [],
                   "model": self.model, "stop_reason": None, "stop_sequence": None,
                   "usage": usage}
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                              "content_block": {"type": "text", "text": ""}}),
        ]

    @staticmethod
    def delta_event(text: str) -> bytes:
        return sse_event("content_block_delta", {
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text},
        })

    @staticmethod
    def end_events(stop_reason: str, usage: dict[str, Any]) -> list[bytes]:
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse_event("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                "usage": usage,
            }),
            sse_event("message_stop", {"type": "message_stop"}),
        ]


# --------------------------------------------------------------------------- embeddings


def embedding_vector(token_ids: Sequence[int], dimensions: int) -> list[float]:
    """A deterministic unit vector of the token ids (equal text gives equal vectors)."""
    vector = [0.0] * dimensions
    for position, token in enumerate(token_ids):
        digest = xxhash.xxh3_64_intdigest(f"{token}".encode())
        # Each token adds +-1/(1+position/64) to one dimension: order matters, weakly.
        sign = 1.0 if digest & 1 else -1.0
        vector[(digest >> 1) % dimensions] += sign / (1.0 + position / 64)
    norm = sum(v * v for v in vector) ** 0.5 or 1.0
    return [v / norm for v in vector]


def embedding_data(index: int, vector: list[float], encoding_format: str) -> dict[str, Any]:
    """``EmbeddingResponseData``: floats, or base64 of little-endian float32 (the SDK's default)."""
    if encoding_format == "base64":
        raw = struct.pack(f"<{len(vector)}f", *vector)
        encoded: list[float] | str = base64.b64encode(raw).decode("ascii")
    else:
        encoded = vector
    return {"index": index, "object": "embedding", "embedding": encoded}


def embedding_response(
    model: str, data: list[dict[str, Any]], prompt_tokens: int
) -> dict[str, Any]:
    """``EmbeddingResponse``; usage counts prompt tokens only."""
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": None},
    }
