"""Shared building blocks of the policy schema: the strict base model and checked scalar types.

Everything is decoded strictly: unknown keys are errors and YAML's loose scalars are not coerced
(``"8"`` is not an integer, ``yes`` is not a name), because a silently reinterpreted routing
policy is worse than a refused one.
"""

from __future__ import annotations

import posixpath
import re
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from routing.index.redis_client import check_cluster_url, is_cluster_url
from routing.redis_sentinel import check_primary_url, is_sentinel_url
from routing.redis_urls import check_url_options


class StrictModel(BaseModel):
    """Base of every policy section: unknown keys forbidden, no type coercion, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# Model and adapter names follow vLLM/Hugging Face: "meta-llama/Llama-3.1-8B-Instruct", "a:b".
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
_SHA256_HEX = re.compile(r"^[0-9a-fA-F]{64}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def _check_name(value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(
            f"must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit "
            f"(got {value!r})"
        )
    return value


def _check_model_name(value: str) -> str:
    if not _MODEL_NAME.match(value) or "//" in value or ".." in value:
        shown = value if len(value) <= 80 else f"{value[:40]}...{value[-20:]} ({len(value)} chars)"
        raise ValueError(
            "must be a model name like 'org/model-7b': 1-200 letters, digits, '.', '_', '-', "
            f"':' or '/', starting with a letter or digit, without '//' or '..' (got {shown!r})"
        )
    return value


def _check_sha256(value: str) -> str:
    if not _SHA256_HEX.match(value):
        # Never echo the value: a raw key pasted here must not end up in logs.
        raise ValueError(
            "must be the hex SHA-256 of the key (64 hex characters), never the key itself; "
            "compute it with `fleetgate policy hash-key`"
        )
    return value.lower()


def check_http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL with a host (got {value!r})")
    return value.rstrip("/")


def _check_redis_url(value: str) -> str:
    """One Redis server's URL, or its Sentinels' (``redis+sentinel://``, ``rediss+sentinel://``)."""
    check_primary_url(value)  # a ValueError saying which option, node or service does not read
    return value if is_sentinel_url(value) else _check_server_url(value)


def _check_server_url(value: str) -> str:
    """A ``redis://``, ``rediss://`` or ``unix://`` URL with a host (a socket needs none)."""
    parts = urlsplit(value)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            "must be a redis://, rediss:// or unix:// URL, or a Sentinel group's "
            "redis+sentinel://sentinel-0:26379,sentinel-1:26379/SERVICE/DB"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError("must name a host, e.g. redis://redis:6379/0")
    return value


def _check_index_redis_url(value: str) -> str:
    """A Redis URL, a Sentinel group's, or a Redis Cluster's (``redis+cluster://``,
    ``rediss+cluster://``)."""
    if is_cluster_url(value):
        check_url_options(value)
        return check_cluster_url(value)  # a ValueError naming the node it cannot read
    if is_sentinel_url(value) or ("?" in value and value.startswith(("redis", "unix://"))):
        check_primary_url(value)  # its own message (an option, a node), not the list below
        if is_sentinel_url(value):
            return value
    try:
        return _check_server_url(value)
    except ValueError:
        raise ValueError(
            "must be a redis://, rediss:// or unix:// URL, a Sentinel group's "
            "redis+sentinel:// or rediss+sentinel:// URL, or a Redis Cluster's "
            "redis+cluster:// or rediss+cluster:// URL"
        ) from None


def check_local_path(value: str) -> str:
    """An absolute, normalised POSIX path with no ``..`` component.

    Adapter and tokenizer paths are handed to vLLM and to loaders on other machines; a relative or
    traversing path would resolve differently (or somewhere unintended) there.
    """
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path (got {value!r})")
    if ".." in value.split("/"):
        raise ValueError(f"must not contain '..' (got {value!r})")
    if posixpath.normpath(value) != value or value.startswith("//"):
        raise ValueError(f"must be normalised, e.g. {posixpath.normpath(value)!r} (got {value!r})")
    return value


def _check_header_name(value: str) -> str:
    if not _HEADER_NAME.match(value):
        raise ValueError(f"must be an HTTP header name (got {value!r})")
    # HTTP header names are case-insensitive; store one spelling so matching is a dict lookup.
    return value.lower()


#: Name of a pool, route, plugin, profile or tenant; also used as a metric label value.
Name = Annotated[str, AfterValidator(_check_name)]
#: Name of a base model or LoRA adapter as clients send it in ``model``.
ModelName = Annotated[str, AfterValidator(_check_model_name)]
Sha256Hex = Annotated[str, AfterValidator(_check_sha256)]
HttpUrl = Annotated[str, AfterValidator(check_http_url)]
RedisUrl = Annotated[str, AfterValidator(_check_redis_url)]
#: Where the block index lives: one Redis server or, in mirror mode, a Redis Cluster.
IndexRedisUrl = Annotated[str, AfterValidator(_check_index_redis_url)]
LocalPath = Annotated[str, AfterValidator(check_local_path)]
HeaderName = Annotated[str, AfterValidator(_check_header_name)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
KeyPrefix = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:-]+$")]
