"""``RemoteTokenizer``: ask a vLLM server's ``POST /tokenize`` and cache the answers.

Useful when the gateway cannot load the model's tokenizer files: the engine tokenizes exactly as
it will for the real request. Answers are cached in an LRU keyed by a hash of the request body,
and identical requests in flight at the same time share one upstream call (a shared system
prompt arriving in a burst costs one round trip).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import xxhash

from routing.contracts import TokenizedPrompt
from routing.tokenize.errors import TokenizationError
from routing.tokenize.messages import normalise_messages
from routing.tokenize.scope import TOKENIZE_CACHE_SCOPE

__all__ = ["RemoteTokenizer"]


class RemoteTokenizer:
    """Tokenizes through vLLM's ``/tokenize`` endpoint at ``base_url`` (e.g. ``http://r0:8000``).

    Chat requests send ``add_generation_prompt`` (default ``True``) and any other template
    keyword arguments as vLLM's ``TokenizeChatRequest`` fields; vLLM then applies the template and
    tokenizes without special tokens, and completion prompts with them, as for real requests.
    Failures (connection, timeout, non-2xx, malformed body) raise ``TokenizationError``.
    """

    def __init__(
        self,
        base_url: str,
        *,
        cache_size: int = 4096,
        timeout_s: float = 2.0,
        client: httpx.AsyncClient | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL (got {base_url!r})")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"cache_size must be an integer >= 0 (got {cache_size!r})")
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number of seconds > 0 (got {timeout_s!r})")
        self.url = base_url.rstrip("/") + "/tokenize"
        self._client = client or httpx.AsyncClient(timeout=timeout_s, headers=dict(headers or {}))
        self._owns_client = client is None
        self._cache_size = cache_size
        self._cache: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._inflight: dict[int, asyncio.Future[tuple[int, ...]]] = {}
        self.hits = 0
        self.misses = 0

    async def tokenize_completion(self, model: str, prompt: str) -> TokenizedPrompt:
        """Token ids of a completion prompt, as the upstream vLLM tokenizes it."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string (got {type(prompt).__name__})")
        return await self._tokenize({"model": model, "prompt": prompt})

    async def tokenize_chat(
        self, model: str, messages: Sequence[Mapping[str, Any]], **template_kwargs: Any
    ) -> TokenizedPrompt:
        """Token ids of a chat request after the upstream applied its chat template."""
        normalise_messages(messages)  # refuse malformed messages here, not as an upstream 400
        return await self._tokenize(tokenize_chat_body(model, messages, template_kwargs))

    async def _tokenize(self, body: dict[str, Any]) -> TokenizedPrompt:
        try:
            payload = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tokenize request is not JSON-serialisable: {exc}") from exc
        # Per tenant (``scope.py``): a hit or a shared in-flight call must not tell one tenant
        # that another just sent the same prompt.
        key = xxhash.xxh3_128_intdigest(
            TOKENIZE_CACHE_SCOPE.get().encode() + b"\0" + payload.encode()
        )
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return TokenizedPrompt(token_ids=cached)
        pending = self._inflight.get(key)
        if pending is not None:
            self.hits += 1
            return TokenizedPrompt(token_ids=await asyncio.shield(pending))
        self.misses += 1
        future: asyncio.Future[tuple[int, ...]] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            tokens = await self._fetch(payload)
        except asyncio.CancelledError:
            # Only the caller that led the fetch was cancelled; those sharing it get an error.
            _fail(future, TokenizationError(f"POST {self.url} was cancelled"))
            raise
        except Exception as exc:
            _fail(future, exc)
            raise
        finally:
            del self._inflight[key]
        future.set_result(tokens)
        self._remember(key, tokens)
        return TokenizedPrompt(token_ids=tokens)

    async def _fetch(self, payload: str) -> tuple[int, ...]:
        try:
            response = await self._client.post(
                self.url, content=payload, headers={"Content-Type": "application/json"}
            )
        except httpx.HTTPError as exc:
            raise TokenizationError(f"POST {self.url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise TokenizationError(
                f"POST {self.url} answered {response.status_code}: {response.text[:300]}"
            )
        try:
            tokens = response.json()["tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise TokenizationError(f"POST {self.url}: no 'tokens' in the answer") from exc
        if not isinstance(tokens, list) or not all(
            isinstance(token, int) and not isinstance(token, bool) for token in tokens
        ):
            raise TokenizationError(f"POST {self.url}: 'tokens' must be a list of integers")
        return tuple(tokens)

    def _remember(self, key: int, tokens: tuple[int, ...]) -> None:
        if self._cache_size == 0:
            return
        self._cache[key] = tokens
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    async def close(self) -> None:
        """Close the HTTP client if this tokenizer created it."""
        if self._owns_client:
            await self._client.aclose()


def _fail(future: asyncio.Future[tuple[int, ...]], exc: BaseException) -> None:
    future.set_exception(exc)
    future.exception()  # mark it retrieved: there may be no one else waiting on it


#: Template variables that ``/tokenize`` takes as fields of its own; vLLM hands every other one
#: to the template through ``chat_template_kwargs`` (a top-level field it does not know is
#: ignored, which would tokenize a prompt the chat endpoint never renders).
_TOKENIZE_FIELDS = ("add_generation_prompt", "continue_final_message", "tools")


def tokenize_chat_body(
    model: str, messages: Sequence[Mapping[str, Any]], template_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """vLLM's ``/tokenize`` body for ``messages`` rendered with ``template_kwargs``."""
    body: dict[str, Any] = {"add_generation_prompt": True}
    extra: dict[str, Any] = {}
    for name, value in template_kwargs.items():
        if name in _TOKENIZE_FIELDS:
            if value is not None:
                body[name] = value
        elif value is not None:
            extra[name] = value
    if extra:
        body["chat_template_kwargs"] = extra
    body.update(model=model, messages=list(messages))
    return body
