"""Where the engines are: replica pools and the base models they serve."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_serializer, model_validator

from routing.config.base import (
    HttpUrl,
    KeyPrefix,
    LocalPath,
    ModelName,
    Name,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    RedisUrl,
    StrictModel,
    check_http_url,
)


class Discovery(StrictModel):
    """Replicas that register themselves in Redis (the replica agent writes these keys)."""

    redis_url: RedisUrl
    key_prefix: KeyPrefix = "fleetgate:"


class StaticReplica(StrictModel):
    """A statically listed engine: a bare URL (id ``<pool>/<position>``) or ``{name, url}`` (id
    ``<pool>/<name>`` wherever it stands in the list, so removing another renames nothing)."""

    url: HttpUrl
    name: Name | None = None

    @model_serializer(mode="wrap")
    def _as_written(self, handler: Any) -> Any:
        # Shown back (`fleetgate policy show`) the way it was written: a bare URL stays one.
        return self.url if self.name is None else handler(self)


def _static_replica(value: Any) -> Any:
    """A bare URL is ``{url}``; anything but a string or a mapping gets a message saying both."""
    if isinstance(value, str):
        # Checked here, so that a bad bare URL's error names the entry, not a `url` key it lacks.
        return {"url": check_http_url(value)}
    if isinstance(value, dict):
        return value
    raise ValueError(f"must be a URL or a mapping {{name, url}} (got {value!r})")


class ReplicaPool(StrictModel):
    """A group of identical vLLM engines (same GPU type, same flags).

    Replicas are listed statically (``replicas``), discovered through Redis (``discovery``), or
    both; a pool with neither could never serve anything.
    """

    name: Name
    #: Base URLs of vLLM OpenAI servers, e.g. ``http://10.0.0.5:8000`` (id ``<pool>/<position>``),
    #: or ``{name, url}`` (id ``<pool>/<name>``).
    replicas: list[Annotated[StaticReplica, BeforeValidator(_static_replica)]] = Field(
        default_factory=list
    )
    discovery: Discovery | None = None
    #: USD per GPU-hour; may instead come from the top-level ``prices`` section.
    gpu_price_per_hour: PositiveFloat | None = None
    gpus_per_replica: PositiveInt = 1
    #: vLLM ``--block-size``: tokens per KV block, the prefix-hashing granularity.
    block_size: PositiveInt = 16
    #: Starting prefill-throughput estimate (tokens/s) before online calibration.
    prefill_tokens_per_s: PositiveFloat = 10_000.0
    #: Time of one decode step with an empty context (ms), about the weights' bytes over the
    #: GPU's memory bandwidth (an 8B model in bf16 on an H100: ~7 ms): routing's estimate of
    #: the step each running request holds, and of a short answer's slack under its TPOT.
    decode_step_ms: PositiveFloat = 30.0
    #: vLLM ``--max-loras`` / ``--max-cpu-loras`` (GPU and host LoRA slots per engine).
    max_loras: NonNegativeInt | None = None
    max_cpu_loras: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _has_replicas(self) -> ReplicaPool:
        if not self.replicas and self.discovery is None:
            raise ValueError("needs static 'replicas', 'discovery', or both")
        urls = self.replica_urls()
        if len(set(urls)) != len(urls):
            raise ValueError("'replicas' lists the same URL twice")
        ids = self.static_ids()
        if len(set(ids)) != len(ids):
            raise ValueError("'replicas' gives two replicas the same name (or a name that is "
                             "another's position)")
        for url in urls:
            root = url.rstrip("/")
            if root.lower().endswith("/v1"):
                # The gateway adds /v1/chat/completions itself: it would call /v1/v1/...
                raise ValueError(
                    f"replica {url} ends in /v1: list the engine's root URL "
                    f"({root[: -len('/v1')]}); the gateway adds the API path"
                )
        if (
            self.max_loras is not None
            and self.max_cpu_loras is not None
            and self.max_cpu_loras < self.max_loras
        ):
            # vLLM refuses to start with this combination; quote both settings.
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        return self

    def replica_urls(self) -> list[str]:
        """The static replicas' URLs, in list order."""
        return [r.url for r in self.replicas]

    def static_ids(self) -> list[str]:
        """The static replicas' ids, in list order: ``<pool>/<name>``, or ``<pool>/<position>``
        for a bare URL."""
        return [
            f"{self.name}/{i if r.name is None else r.name}" for i, r in enumerate(self.replicas)
        ]


class TokenizerSpec(StrictModel):
    """How the gateway turns a prompt into the tokens the engine will see.

    ``local``: a tokenizer directory or ``tokenizer.json`` on the gateway's disk (exact);
    ``remote``: the engine's own ``/tokenize`` endpoint at ``url`` (exact, one extra hop);
    ``text``: no tokenizer, blocks are made of characters (approximate prefix matching).
    """

    kind: Literal["local", "remote", "text"]
    path: LocalPath | None = None
    url: HttpUrl | None = None

    @model_validator(mode="after")
    def _fields_match_kind(self) -> TokenizerSpec:
        needs = {"local": "path", "remote": "url", "text": None}[self.kind]
        for key in ("path", "url"):
            given = getattr(self, key) is not None
            if key == needs and not given:
                raise ValueError(f"kind '{self.kind}' needs '{key}'")
            if key != needs and given:
                raise ValueError(f"kind '{self.kind}' does not take '{key}'")
        return self


class ModelSpec(StrictModel):
    """A base model, the tokenizer that matches it, and the pools that serve it."""

    name: ModelName
    tokenizer: TokenizerSpec = Field(default_factory=lambda: TokenizerSpec(kind="text"))
    #: Overrides the pools' block size for hashing; must then equal every pool's.
    block_size: PositiveInt | None = None
    pools: list[Name] = Field(min_length=1)
