"""A simulated vLLM replica: vLLM 0.32's HTTP API, metrics and KV events over a modelled engine.

Endpoints (as vLLM serves them): ``/v1/completions`` and ``/v1/chat/completions`` (streaming and
not), ``/v1/models``, ``/tokenize``, the Responses, Anthropic Messages, embeddings and
``/detokenize`` endpoints of ``replica.sim.api_server``, ``/health``, ``/version``, ``/metrics``,
and the runtime-LoRA ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``. Errors use vLLM's
envelope and status codes. Text is deterministic filler; timings, prefix-cache hits, preemptions,
adapter loads and KV events come from ``replica.sim.engine.EngineModel`` driven in real time by
``EngineDriver``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from replica.kv_events import KVEventPublisher
from replica.sim.driver import EngineDriver, RequestAborted, RequestStream
from replica.sim.engine import EngineConfig, EngineModel
from replica.sim.metrics import PROMETHEUS_CONTENT_TYPE, ReplicaMetrics
from replica.sim.responses import (
    SSE_DONE,
    ChatShapes,
    CompletionShapes,
    error_body,
    model_card,
    sse,
    usage,
)
from routing.tokenize.word_hash import SimTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

#: The vLLM release whose wire formats this replica speaks (``/version``).
VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class SimServerConfig:
    """Settings of one simulated replica."""

    #: Name served as the base model (vLLM's ``--served-model-name``).
    model: str = "sim-model"
    #: Engine preset (``replica/sim/profiles/presets.yaml``) and ``EngineConfig`` overrides.
    profile: str = "h100-llama3-8b"
    engine_overrides: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    #: Modelled seconds per wall second; tests run at 100× or more.
    speed: float = 1.0
    #: vLLM's ``--kv-events-config`` endpoint (``tcp://*:5557`` binds) and replay endpoint.
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_topic: str = "kv"
    #: A Hugging Face tokenizer directory; None uses the built-in word-hash tokenizer.
    tokenizer_dir: str | None = None
    #: Requests waiting beyond this are refused with 503 (vLLM itself queues without bound).
    max_waiting: int = 1024
    #: Output length when a request gives none; vLLM uses the whole remaining context, which
    #: would make a simulated curl run for minutes. None restores vLLM's behaviour.
    default_max_tokens: int | None = 256
    #: Report ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``).
    enable_prompt_tokens_details: bool = True
    #: Keep ``/v1/responses`` answers for ``previous_response_id`` and ``GET /v1/responses/{id}``
    #: (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``; without it vLLM ignores ``store``).
    responses_store: bool = True


class ApiError(Exception):
    """An error answered in vLLM's envelope."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        """The JSON error envelope."""
        return error_body(self.message, self.err_type, self.status, self.param)

    def response(self) -> web.Response:
        """The error as an HTTP response."""
        return web.json_response(self.body(), status=self.status)


def _aborted() -> ApiError:
    return ApiError(
        503, "The request was aborted: the replica is shutting down.", "ServiceUnavailableError"
    )


@dataclass
class SimReplica:
    """The live parts of one replica, built when its app starts."""

    config: SimServerConfig
    engine_config: EngineConfig
    engine: EngineModel
    metrics: ReplicaMetrics
    driver: EngineDriver
    tokenizer: SimTokenizer
    publisher: KVEventPublisher | None
    #: Loaded adapters: name -> path, in load order (``/v1/models``).
    loras: dict[str, str] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    #: Serialises adapter loads/unloads, as vLLM's per-name lock does.
    lora_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def create(cls, config: SimServerConfig, tokenizer: SimTokenizer | None = None) -> SimReplica:
        """Build the engine, metrics, publisher and driver (needs a running event loop)."""
        engine_config = EngineConfig.from_profile(config.profile, **dict(config.engine_overrides))
        engine = EngineModel(engine_config, seed=config.seed)
        tok = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer_dir)
        metrics = ReplicaMetrics(config.model, engine_config)
        publisher = None
        if config.kv_events_endpoint is not None:
            publisher = KVEventPublisher(
                endpoint=config.kv_events_endpoint,
                topic=config.kv_topic,
                replay_endpoint=config.kv_replay_endpoint,
            )
        driver = EngineDriver(engine, metrics, tok.filler_token, publisher, speed=config.speed)
        return cls(config, engine_config, engine, metrics, driver, tok, publisher)

    @property
    def max_model_len(self) -> int:
        return self.engine_config.model_len

    def resolve_model(self, name: Any) -> str | None:
        """The adapter a request's ``model`` names (None for the base model); 404 otherwise."""
        if name is None or name == self.config.model:
            return None
        if isinstance(name, str) and name in self.loras:
            return name
        raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


REPLICA_KEY = web.AppKey("sim_replica", SimReplica)
CONFIG_KEY = web.AppKey("sim_config", SimServerConfig)
TOKENIZER_KEY = web.AppKey("sim_tokenizer", SimTokenizer)

_decoder = msgspec.json.Decoder()


# --------------------------------------------------------------------------- request helpers


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = _decoder.decode(await request.read())
    except RecursionError:
        # msgspec's stack guard, past ~1,000 levels: a client error, not a server one.
        raise ApiError(400, "Invalid JSON body: nested too deeply.") from None
    except ValueError as exc:  # msgspec.DecodeError, and UnicodeDecodeError for invalid UTF-8
        raise ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def _max_tokens(replica: SimReplica, value: Any, prompt_len: int, param: str) -> int:
    room = replica.max_model_len - prompt_len
    if value is None:
        default = replica.config.default_max_tokens
        value = room if default is None else min(default, room)
        if value < 1:
            raise ApiError(400, _context_message(replica, prompt_len, 1), param="messages")
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{param} must be an integer, got {value!r}.", param=param)
    if value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}.", param=param)
    if value > room:
        raise ApiError(400, _context_message(replica, prompt_len, value), param=param)
    return value


def _context_message(replica: SimReplica, prompt_len: int, max_tokens: int) -> str:
    return (
        f"This model's maximum context length is {replica.max_model_len} tokens. However, you "
        f"requested {max_tokens} output tokens and your prompt contains at least "
        f"{prompt_len} input tokens, for a total of at least {prompt_len + max_tokens} tokens. "
        "Please reduce the length of the input prompt or the number of requested output tokens."
    )


def _completion_prompt(replica: SimReplica, prompt: Any, add_special_tokens: bool) -> list[int]:
    """``prompt`` as vLLM accepts it for one choice: text, token ids, or a one-element list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return replica.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ApiError(
        400, "prompt must be a string, a list of token ids, or a one-element list of either "
        "(the simulated replica serves one prompt per request).", param="prompt",
    )


def _chat_prompt(replica: SimReplica, messages: Any, add_generation_prompt: bool) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    try:
        return replica.tokenizer.encode_chat(messages, add_generation_prompt)
    except (ValueError, TypeError, AttributeError) as exc:
        raise ApiError(400, f"Invalid messages: {exc}", param="messages") from exc


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.",
                       param="cache_salt")
    return salt


#: Sampling fields vLLM's request models type as numbers: what pydantic cannot read as one (a
#: word, a list) is its 400 (the sim samples nothing, but a client tested against it must meet
#: the same refusal).
_NUMERIC_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty")
#: ... and as integers: a fraction there is refused too (a whole float, 5.0, is read as 5).
_INTEGER_FIELDS = ("top_k", "seed")


def _check_n(body: Mapping[str, Any]) -> None:
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "The simulated replica supports only n=1.", param="n")
    for name in _NUMERIC_FIELDS:
        value = body.get(name)
        if value is None or isinstance(value, int | float) or _numeric_text(value):
            continue
        raise ApiError(400, f"Parameter '{name}' must be a number (got {value!r}).", param=name)
    for name in _INTEGER_FIELDS:
        value = body.get(name)
        if value is None or _whole_number(value):
            continue
        raise ApiError(400, f"Parameter '{name}' must be an integer (got {value!r}).", param=name)


def _whole_number(value: Any) -> bool:
    """An int, or what pydantic reads as one (5.0, "5")."""
    if isinstance(value, int):
        return True
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, str):
        try:
            int(value)
        except ValueError:
            return False
        return True
    return False


def _numeric_text(value: Any) -> bool:
    """A string pydantic reads as a number ("0.7")."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _priority(body: Mapping[str, Any]) -> int:
    """vLLM's ``priority`` field (lower is served first; 0 when absent)."""
    value = body.get("priority", 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, "Parameter 'priority' must be an integer.", param="priority")
    return value


def _submit(
    replica: SimReplica, prompt: list[int], max_tokens: int, adapter: str | None,
    salt: str | None, request_id: str | None, priority: int = 0,
) -> RequestStream:
    if replica.engine.stats().waiting >= replica.config.max_waiting:
        raise ApiError(503, "The server is overloaded: too many requests are waiting.",
                       "ServiceUnavailableError")
    try:
        return replica.driver.submit(prompt, max_tokens, adapter, salt, request_id, priority)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


# --------------------------------------------------------------------------- generation


async def _generate(
    request: web.Request,
    replica: SimReplica,
    stream: RequestStream,
    shapes: CompletionShapes | ChatShapes,
    body: Mapping[str, Any],
) -> web.StreamResponse:
    details = replica.config.enable_prompt_tokens_details
    decode = replica.tokenizer.decode
    try:
        if not body.get("stream"):
            pieces: list[str] = []
            while tokens := await stream.next_tokens():
                pieces.append(decode(tokens))
            use = usage(stream.prompt_tokens, stream.generated,
                        stream.cached_tokens if details else None)
            return web.json_response(shapes.full("".join(pieces), "length", use))

        options = body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8",
                     "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # vLLM writes the chat role chunk on its generator's first output, i.e. with the first
        # token: sent before prefill, it would read as the first token to the gateway (its TTFT,
        # its prefill backlog and its prefill-speed calibration would all be wrong on sims).
        role_pending = isinstance(shapes, ChatShapes)
        try:
            while tokens := await stream.next_tokens():
                if role_pending:
                    role_pending = False
                    await response.write(sse(shapes.role_chunk()))
                finish = "length" if stream.finished and not stream.pending else None
                await response.write(sse(shapes.chunk(decode(tokens), finish)))
        except RequestAborted:
            # Headers are out: like vLLM, report the failure as an event, then end the stream.
            await response.write(sse(_aborted().body()))
            await response.write(SSE_DONE)
            await response.write_eof()
            return response
        if include_usage:
            use = usage(stream.prompt_tokens, stream.generated,
                        stream.cached_tokens if details else None)
            await response.write(sse(shapes.usage_chunk(use)))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response
    except RequestAborted as exc:
        raise _aborted() from exc
    finally:
        # A client that went away mid-stream must not keep its KV blocks in the engine.
        if not stream.finished:
            replica.driver.abort(stream.request_id)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    adapter = replica.resolve_model(body.get("model"))
    _check_n(body)
    if "prompt" not in body:
        raise ApiError(400, "Field required: prompt", param="prompt")
    prompt = _completion_prompt(replica, body["prompt"], bool(body.get("add_special_tokens", True)))
    max_tokens = _max_tokens(replica, body.get("max_tokens"), len(prompt), "max_tokens")
    stream = _submit(replica, prompt, max_tokens, adapter, _cache_salt(body),
                     request.headers.get("X-Request-Id"), _priority(body))
    shapes = CompletionShapes(body.get("model") or replica.config.model)
    return await _generate(request, replica, stream, shapes, body)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    adapter = replica.resolve_model(body.get("model"))
    _check_n(body)
    prompt = _chat_prompt(replica, body.get("messages"),
                          bool(body.get("add_generation_prompt", True)))
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _max_tokens(replica, requested, len(prompt), "max_tokens")
    stream = _submit(replica, prompt, max_tokens, adapter, _cache_salt(body),
                     request.headers.get("X-Request-Id"), _priority(body))
    shapes = ChatShapes(body.get("model") or replica.config.model)
    return await _generate(request, replica, stream, shapes, body)


# --------------------------------------------------------------------------- other endpoints


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: a completion ``prompt`` or chat ``messages`` -> token ids."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    replica.resolve_model(body.get("model"))
    if "messages" in body:
        tokens = _chat_prompt(replica, body["messages"],
                              bool(body.get("add_generation_prompt", True)))
    elif isinstance(body.get("prompt"), str):
        tokens = replica.tokenizer.encode(
            body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))
        )
    else:
        raise ApiError(400, "Either 'prompt' (a string) or 'messages' must be provided.")
    return web.json_response({"count": len(tokens), "max_model_len": replica.max_model_len,
                              "tokens": tokens, "token_strs": None})


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the base model, then each loaded adapter with its ``parent``."""
    replica = request.app[REPLICA_KEY]
    base = replica.config.model
    cards = [model_card(base, base, replica.max_model_len, None, replica.created)]
    cards += [model_card(name, path, None, base, replica.created)
              for name, path in replica.loras.items()]
    return web.json_response({"object": "list", "data": cards})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``, vLLM's checks and texts."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path or not isinstance(name, str) or not isinstance(path, str):
        raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                       "InvalidUserInput")
    if name == replica.config.model:
        raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                       "InvalidUserInput")
    async with replica.lora_lock:
        if name in replica.loras and not body.get("load_inplace", False):
            raise ApiError(
                400, f"The lora adapter '{name}' has already been loaded. If you want to load "
                "the adapter in place, set 'load_inplace' to True.", "InvalidUserInput",
            )
        size_mb = body.get("size_mb")  # sim-only: models the adapter's load time
        try:
            load_s = replica.engine.load_adapter(
                name, float(size_mb) if isinstance(size_mb, int | float) else None
            )
        except (ValueError, RuntimeError) as exc:
            # LoRA disabled, or every host slot pinned: vLLM reports engine failures as 500.
            raise ApiError(500, str(exc), "InternalServerError") from exc
        # vLLM answers once the adapter is loaded; the modelled load takes this long.
        await asyncio.sleep(load_s / replica.config.speed)
        replica.driver.lora_id(name)
        replica.loras[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """``POST /v1/unload_lora_adapter`` ``{"lora_name"}``."""
    replica = request.app[REPLICA_KEY]
    body = await _json_body(request)
    name = body.get("lora_name")
    if not name or not isinstance(name, str):
        raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                       "InvalidUserInput")
    async with replica.lora_lock:
        if name not in replica.loras:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        # vLLM forgets the name at once; in-flight requests on it finish (the engine refuses to
        # drop an adapter in use, which is fine: the name is no longer served either way).
        with contextlib.suppress(KeyError, ValueError):
            replica.engine.unload_adapter(name)
        del replica.loras[name]
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """``POST /reset_prefix_cache`` (vLLM dev mode): drop every cached block.

    Emits ``AllBlocksCleared`` with the next engine step. 400 while blocks are in use.
    """
    replica = request.app[REPLICA_KEY]
    if not replica.engine.reset_prefix_cache():
        raise ApiError(400, "Failed to reset prefix cache: blocks are in use by running requests.")
    replica.driver.poke()
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """``GET /health``: 200 with an empty body while the engine runs."""
    return web.Response(status=200)


async def version(request: web.Request) -> web.Response:
    """``GET /version``."""
    return web.json_response({"version": VLLM_VERSION})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: this replica's registry in Prometheus text format."""
    replica = request.app[REPLICA_KEY]
    return web.Response(body=replica.metrics.render(),
                        headers={"Content-Type": PROMETHEUS_CONTENT_TYPE})


# --------------------------------------------------------------------------- the app


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPNotFound:
        return ApiError(404, f"Not Found: {request.path}", "NotFoundError").response()
    except web.HTTPMethodNotAllowed:
        return ApiError(405, "Method Not Allowed", "MethodNotAllowed").response()


async def _replica_ctx(app: web.Application) -> AsyncIterator[None]:
    """Build the replica, run its engine loop and replay socket, and stop both on cleanup."""
    tokenizer = app.get(TOKENIZER_KEY)
    replica = SimReplica.create(app[CONFIG_KEY], tokenizer)
    app[REPLICA_KEY] = replica
    tasks = [asyncio.create_task(replica.driver.run(), name="sim-engine")]
    if replica.publisher is not None:
        tasks.append(asyncio.create_task(replica.publisher.serve_replay(), name="sim-kv-replay"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if replica.publisher is not None:
            replica.publisher.close()


def build_core_app(
    config: SimServerConfig, tokenizer: SimTokenizer | None = None
) -> web.Application:
    """One simulated replica's completions, chat, models, LoRA, health and metrics routes.

    ``replica.sim.app.build_app`` adds vLLM's other APIs (``api_server.py``) on top.
    ``tokenizer`` lets several replicas share one loaded tokenizer.
    """
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024 * 1024)
    app[CONFIG_KEY] = config
    if tokenizer is not None:
        app[TOKENIZER_KEY] = tokenizer
    app.cleanup_ctx.append(_replica_ctx)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    return app
