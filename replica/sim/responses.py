"""JSON bodies in exactly the shapes vLLM 0.32's OpenAI server returns.

Kept apart from the HTTP handlers so the shapes can be read (and compared with vLLM's
``entrypoints/openai/*/protocol.py``) in one place. Streaming chunks follow vLLM's
``model_dump_json(exclude_unset=True)``: only the fields vLLM sets appear.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

_json = msgspec.json.Encoder()


def random_id(prefix: str) -> str:
    """vLLM-style ids: ``cmpl-…`` and ``chatcmpl-…`` followed by 32 hex digits."""
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None
) -> dict[str, Any]:
    """``UsageInfo``; ``prompt_tokens_details`` only when prompt-token details are enabled."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as JSON."""
    return b"data: " + _json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class CompletionShapes:
    """Bodies of one ``/v1/completions`` response (``object: text_completion``)."""

    def __init__(self, model: str) -> None:
        self.id = random_id("cmpl")
        self.model = model
        self.created = int(time.time())

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model}

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None}
        return {**self._head(), "choices": [choice]}

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": _drop_none(usage_body)}

    def full(self, text: str, finish_reason: str, usage_body: dict[str, Any]) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                  "stop_reason": None, "prompt_logprobs": None}
        return {**self._head(), "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": usage_body, "kv_transfer_params": None}


class ChatShapes:
    """Bodies of one ``/v1/chat/completions`` response."""

    def __init__(self, model: str) -> None:
        self.id = random_id("chatcmpl")
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def role_chunk(self) -> dict[str, Any]:
        """vLLM's first chunk: the assistant role with empty content."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                  "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [],
                "usage": _drop_none(usage_body)}

    def full(self, text: str, finish_reason: str, usage_body: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                   "audio": None, "function_call": None, "tool_calls": [], "reasoning": None}
        choice = {"index": 0, "message": message, "logprobs": None,
                  "finish_reason": finish_reason, "stop_reason": None}
        return {**self._head("chat.completion"), "choices": [choice], "service_tier": None,
                "system_fingerprint": None, "usage": usage_body, "prompt_logprobs": None,
                "kv_transfer_params": None}


def model_card(
    model_id: str, root: str, max_model_len: int | None, parent: str | None, created: int
) -> dict[str, Any]:
    """One ``ModelCard`` of ``/v1/models``; adapters carry ``parent`` (their base model)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [{
            "id": random_id("modelperm"),
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }],
    }


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's final usage chunk is dumped with ``exclude_none=True``."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in body.items()
            if v is not None}
