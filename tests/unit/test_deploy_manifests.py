"""Every Kubernetes overlay renders with kustomize and validates against Kubernetes schemas."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.33"
#: Operator CRDs are not in the Kubernetes schema set: they are checked against vendored subsets.
CRD_SCHEMAS = {
    "ServiceMonitor": DEPLOY / "schemas" / "servicemonitor.schema.json",
    "PrometheusRule": DEPLOY / "schemas" / "prometheusrule.schema.json",
}


def render(overlay: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize OVERLAY`` as a list of manifests."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with built-in kustomize) is needed to render deploy/overlays"
    result = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"kustomize failed for {overlay}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_overlays_exist() -> None:
    assert {p.name for p in OVERLAYS} >= {"dev", "prod"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_renders_and_validates(overlay: Path) -> None:
    manifests = render(overlay)
    kinds = {m["kind"] for m in manifests}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler",
            "PodDisruptionBudget", "ConfigMap", "ServiceMonitor", "PrometheusRule"} <= kinds
    for manifest in manifests:
        where = f"{overlay.name}: {manifest['kind']}/{manifest['metadata']['name']}"
        schema_path = CRD_SCHEMAS.get(manifest["kind"])
        if schema_path is not None:
            jsonschema.validate(manifest, json.loads(schema_path.read_text()))
            continue
        try:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:  # pragma: no cover - on failure
            pytest.fail(f"{where}: {error.message} at {list(error.path)}")


def test_prod_has_two_pools_and_ha_gateways() -> None:
    manifests = render(DEPLOY / "overlays" / "prod")
    pools = [m for m in manifests if m["kind"] == "StatefulSet" and
             m["metadata"]["name"].startswith("vllm-")]
    assert len(pools) == 2
    for pool in pools:
        selector = pool["spec"]["selector"]["matchLabels"]
        assert selector["fleetgate.io/pool"] == pool["spec"]["template"]["metadata"]["labels"][
            "fleetgate.io/pool"]
        assert pool["spec"]["serviceName"] == pool["metadata"]["name"]
        containers = {c["name"]: c for c in pool["spec"]["template"]["spec"]["containers"]}
        assert {"vllm", "agent"} <= set(containers)
        env = {e["name"]: e.get("value") for e in containers["vllm"]["env"]}
        assert env["PYTHONHASHSEED"] == "0"
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
        assert any("kv-events-config" in a for a in containers["vllm"]["args"])
    gateway = next(m for m in manifests if m["kind"] == "Deployment")
    assert gateway["spec"]["replicas"] >= 3
    hpa = next(m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"
               and m["metadata"]["name"] == "fleetgate-gateway")
    assert all(metric["type"] != "Resource" for metric in hpa["spec"]["metrics"])


@pytest.mark.parametrize(
    "policy_file",
    sorted(p for p in DEPLOY.rglob("policy.yaml") if "broken" not in p.parts),
    ids=lambda p: str(p.relative_to(DEPLOY)),
)
def test_every_shipped_policy_validates(policy_file: Path) -> None:
    from routing.config import load_policy

    policy = load_policy(policy_file)
    assert policy.routes, f"{policy_file} defines no route"


def _gateway(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = next(
        m for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"].startswith("fleetgate-gateway")
    )
    (container,) = (
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"
    )
    return {"spec": deployment["spec"]["template"]["spec"], "container": container}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_gateway_pods_have_their_local_tokenizers(overlay: Path) -> None:
    """A ``kind: local`` tokenizer path of the shipped policy is on a gateway volume (the gateway
    refuses to start without its tokenizer.json: a crash-looping rollout otherwise)."""
    from routing.config import parse_policy

    manifests = render(overlay)
    policy_map = next(
        m for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["name"].startswith("fleetgate-policy")
    )
    policy = parse_policy(policy_map["data"]["policy.yaml"])
    gateway = _gateway(manifests)
    mounts = [m["mountPath"].rstrip("/") for m in gateway["container"].get("volumeMounts", [])]
    for model in policy.models:
        if model.tokenizer.kind == "local":
            path = str(model.tokenizer.path)
            assert any(path == m or path.startswith(m + "/") for m in mounts), (
                f"{overlay.name}: {model.name}'s tokenizer {path} is on no gateway mount {mounts}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_gateway_runs_one_worker_and_scales_on_its_own_load(overlay: Path) -> None:
    """One process per pod (several workers would each serve their own /metrics), and the HPA's
    metric is each pod's own in-flight count, not the fleet-wide per-replica one."""
    manifests = render(overlay)
    args = _gateway(manifests)["container"]["args"]
    workers = [a for a in args if a.startswith("--workers")]
    assert workers in ([], ["--workers=1"]), args
    adapter = next(
        m for m in manifests
        if m["kind"] == "ConfigMap"
        and m["metadata"]["name"].startswith("fleetgate-prometheus-adapter-rules")
    )
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    hpa_rule = next(
        r for r in rules if r["name"]["as"] == "fleetgate_gateway_inflight_requests"
    )
    assert "fleetgate_gateway_inflight_requests" in hpa_rule["metricsQuery"]
    assert "fleetgate_replica_inflight" not in hpa_rule["seriesQuery"] + hpa_rule["metricsQuery"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_engines_drain_before_vllm_gets_sigterm(overlay: Path) -> None:
    """vLLM aborts what it holds on SIGTERM; its preStop hook waits for the requests in flight
    (``replica.drain_wait``), inside the pod's grace period, and the module it runs exists."""
    from replica import drain_wait

    engines = [m for m in render(overlay) if m["kind"] == "StatefulSet"
               and m["spec"]["template"]["metadata"]["labels"].get(
                   "app.kubernetes.io/component") == "engine"]
    assert engines
    for engine in engines:
        pod = engine["spec"]["template"]["spec"]
        (vllm,) = [c for c in pod["containers"] if c["name"] == "vllm"]
        command = vllm["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:3] == ["python3", "-m", drain_wait.__name__]
        settle = float(command[command.index("--settle") + 1])
        timeout = float(command[command.index("--timeout") + 1])
        # Room left for vLLM's own shutdown after the hook.
        assert pod["terminationGracePeriodSeconds"] >= settle + timeout + 15
