"""``requires-kernels``: routing only to replicas whose engines run a given kernel plugin."""

from __future__ import annotations

from typing import Any

import pytest

from routing.config.engine_profiles import build_engine_profiles
from routing.config.errors import PolicyError
from routing.config.loader import parse_policy
from routing.contracts import NoReplicaAvailable, RoutingRequest
from routing.engine import RoutingEngine
from routing.policies.registry import build_plugin
from routing.policies.requires_kernels import RequiresKernelsFilter, parse_requirement
from routing.state import ReplicaState
from routing.types import ReplicaId

MODEL = "m"
PLUGIN = "replica.kernels.vllm_plugin"


def rep(rid: str, kernels: dict[str, str] | None = None, **fields: Any) -> ReplicaState:
    return ReplicaState(replica_id=ReplicaId(rid), url=f"http://{rid}:8000",
                        models=frozenset({MODEL}), kernel_plugins=kernels or {}, **fields)


def req() -> RoutingRequest:
    return RoutingRequest(request_id="r1", model=MODEL, adapter=None, tenant="t", route="main",
                          prompt_tokens=64, seed=3)


def kept(specs: list[str], replicas: list[ReplicaState]) -> list[str]:
    plugin = build_plugin("requires-kernels", {"kernels": specs})
    return [r.replica_id for r in plugin.filter(req(), replicas)]


FLEET = [
    rep("plain"),
    rep("old", {PLUGIN: "0.0.9"}),
    rep("new", {PLUGIN: "0.1.0"}),
    rep("both", {PLUGIN: "0.1.0", "acme_kernels": "1.4.0"}),
]


@pytest.mark.parametrize(("specs", "expected"), [
    ([PLUGIN], ["old", "new", "both"]),                 # any version
    ([f"{PLUGIN}==0.1.0"], ["new", "both"]),             # exactly this version
    ([f"{PLUGIN} == 0.0.9"], ["old"]),                   # spaces around == are fine
    ([PLUGIN, "acme_kernels==1.4.0"], ["both"]),         # every requirement, not any
    (["acme_kernels==2.0"], []),
    ([], ["plain", "old", "new", "both"]),               # no requirement: a no-op
])
def test_keeps_replicas_that_loaded_every_required_kernel(
    specs: list[str], expected: list[str]
) -> None:
    assert kept(specs, FLEET) == expected


@pytest.mark.parametrize(("spec", "parsed"), [
    ("mod", ("mod", None)), ("a.b==1.2.3", ("a.b", "1.2.3")), (" a == 1 ", ("a", "1")),
])
def test_parse_requirement(spec: str, parsed: tuple[str, str | None]) -> None:
    assert parse_requirement(spec) == parsed


@pytest.mark.parametrize("spec", ["", "==1", "mod==", "mod===1", "a b", "mod>=1"])
def test_bad_requirements_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="module==version"):
        RequiresKernelsFilter(RequiresKernelsFilter.Params(kernels=(spec,)))


POLICY = f"""
version: 1
replica_pools:
  - name: gpu
    replicas: ["http://plain:8000", "http://new:8000"]
models:
  - name: {MODEL}
    pools: [gpu]
plugins:
  - type: requires-kernels
    name: fused-norm
    parameters: {{kernels: [{{KERNELS}}]}}
profiles:
  - name: on-our-kernels
    filters: [fused-norm]
    picker: least-loaded
routes:
  - name: main
    match: {{path_prefix: /v1/}}
    profile: on-our-kernels
"""


def engine_for(kernels: str) -> RoutingEngine:
    policy = parse_policy(POLICY.replace("{KERNELS}", kernels))
    return RoutingEngine(None, build_engine_profiles(policy))


async def test_a_policy_profile_routes_only_to_replicas_with_the_kernel() -> None:
    engine = engine_for(f'"{PLUGIN}==0.1.0"')
    # The plain replica is idle and the kernel one busy: the filter, not load, decides.
    replicas = [rep("plain"), rep("new", {PLUGIN: "0.1.0"}, running=7)]
    decision = await engine.route(req(), replicas, "on-our-kernels")
    assert (decision.replica, decision.fallbacks) == ("new", [])
    assert decision.explanations[ReplicaId("plain")].filtered_out_by == "fused-norm"
    assert decision.explanations[ReplicaId("new")].filtered_out_by is None


async def test_no_replica_with_the_kernel_means_no_replica_rather_than_another() -> None:
    engine = engine_for(f'"{PLUGIN}==0.2.0"')
    with pytest.raises(NoReplicaAvailable):
        await engine.route(req(), [rep("plain"), rep("new", {PLUGIN: "0.1.0"})], "on-our-kernels")


def test_a_malformed_requirement_is_a_policy_error_naming_the_parameter() -> None:
    with pytest.raises(PolicyError, match=r"plugins\[0\]\.parameters\.kernels"):
        parse_policy(POLICY.replace("{KERNELS}", '"mod>=1"'))
