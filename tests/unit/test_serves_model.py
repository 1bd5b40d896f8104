"""``serves-model``: health, base model, and the replica's context length."""

from __future__ import annotations

import pytest

from routing.contracts import RoutingRequest
from routing.policies.serves_model import ServesModelFilter, context_needed
from routing.state import ReplicaState
from routing.types import ReplicaId


def _replica(name: str, max_model_len: int | None, healthy: bool = True) -> ReplicaState:
    return ReplicaState(
        ReplicaId(name), f"http://{name}", models=frozenset({"m"}),
        max_model_len=max_model_len, healthy=healthy,
    )


def _request(prompt_tokens: int, max_output_tokens: int | None = None) -> RoutingRequest:
    return RoutingRequest(
        "r", "m", None, "t", "route", prompt_tokens, max_output_tokens=max_output_tokens
    )


FLEET = [_replica("short", 1024), _replica("long", 131_072), _replica("unknown", None)]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "kept"),
    [
        (500, 16, ["short", "long", "unknown"]),
        (1000, 24, ["short", "long", "unknown"]),  # 1,024 exactly: vLLM takes it
        (1000, 25, ["long", "unknown"]),  # one past: vLLM's 400
        (1023, None, ["short", "long", "unknown"]),  # room for one output token
        (1024, None, ["long", "unknown"]),
        (200_000, 16, ["unknown"]),  # an unknown context may be the one that fits
    ],
)
def test_a_replica_is_kept_only_where_the_prompt_and_its_output_fit(
    prompt: int, max_tokens: int | None, kept: list[str]
) -> None:
    chosen = ServesModelFilter().filter(_request(prompt, max_tokens), FLEET)
    assert [r.replica_id for r in chosen] == kept


def test_where_no_replica_fits_every_serving_one_is_kept_and_the_unhealthy_still_dropped() -> None:
    fleet = [_replica("short", 1024), _replica("mid", 4096), _replica("down", 131_072, False)]
    chosen = ServesModelFilter().filter(_request(8000, 16), fleet)
    assert [r.replica_id for r in chosen] == ["short", "mid"]


def test_the_context_needed_is_the_prompt_and_the_output_asked_for() -> None:
    assert context_needed(_request(100, 50)) == 150
    assert context_needed(_request(100)) == 101


def _lora_replica(name: str, max_loras: int | None) -> ReplicaState:
    return ReplicaState(ReplicaId(name), f"http://{name}", models=frozenset({"m"}),
                        max_loras=max_loras)


def test_an_adapter_request_skips_replicas_without_a_lora_slot_while_another_may_have_one() -> None:
    # A burst walked every LoRA-less replica before the one that could load the adapter (the
    # heterogeneous-fleet re-check: 135 failed attempts for 30 requests).
    fleet = [_lora_replica("plain", 0), _lora_replica("lora", 4), _lora_replica("unknown", None)]
    adapter = RoutingRequest("r", "m", "ft-1", "t", "route", 100)
    chosen = ServesModelFilter().filter(adapter, fleet)
    assert [r.replica_id for r in chosen] == ["lora", "unknown"]
    # The base model goes anywhere; with no replica that may load it, the load's error says so.
    assert len(ServesModelFilter().filter(_request(100), fleet)) == 3
    only_plain = [_lora_replica("plain", 0)]
    assert ServesModelFilter().filter(adapter, only_plain) == only_plain
