"""A real Prometheus and promtool for the tests (no tests here).

The binaries come from Debian's ``prometheus`` package (``bash tests/setup_prometheus.sh``). A
missing binary fails the test with that hint instead of skipping it, so CI cannot pass without
them. ``PrometheusServer`` runs a private ``prometheus`` on a free port with a temporary config
and TSDB, never the packaged service.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
ALERT_RULES = REPO / "deploy" / "base" / "prometheus-rules.yaml"
ADAPTER_RULES = REPO / "deploy" / "base" / "prometheus-adapter-rules.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "fleetgate-dashboard.json"
RULE_TESTS = REPO / "deploy" / "prometheus" / "tests"
SETUP_HINT = "run `bash tests/setup_prometheus.sh` (installs Debian's prometheus package)"

#: Grafana's built-in variables, as a Prometheus query needs them: a window that holds several
#: scrapes at the tests' 1 s interval. Dashboard variables of our own would be added here.
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


def require(tool: str) -> str:
    """The path of ``tool`` (``prometheus`` or ``promtool``); fails the test when it is missing."""
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: {SETUP_HINT}", pytrace=False)
    return path


def rule_groups() -> list[dict[str, Any]]:
    """The ``spec.groups`` of the PrometheusRule manifest: what a plain rules file holds."""
    return yaml.safe_load(ALERT_RULES.read_text())["spec"]["groups"]


def write_rules_file(directory: Path) -> Path:
    """The alert (and recording) rules as a plain Prometheus rules file in ``directory``."""
    path = directory / "fleetgate-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups()}, sort_keys=False))
    return path


def rules() -> list[dict[str, Any]]:
    """Every rule of every group (alerts have ``alert``, recording rules ``record``)."""
    return [rule for group in rule_groups() for rule in group["rules"]]


def expand_grafana_variables(expr: str) -> str:
    """``expr`` with ``$var`` / ``${var}`` replaced as Grafana would; unknown ones fail loudly."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in GRAFANA_VARIABLES:
            raise AssertionError(f"no test value for Grafana variable ${name} in {expr!r}")
        return GRAFANA_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


@dataclass(frozen=True)
class PanelQuery:
    """One target of one dashboard panel."""

    panel: str
    unit: str
    ref_id: str
    expr: str

    @property
    def name(self) -> str:
        return f"{self.panel} [{self.ref_id}]"


def panel_queries() -> list[PanelQuery]:
    """Every panel target of the dashboard, Grafana variables expanded."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in panel.get("targets", []):
            expr = expand_grafana_variables(target["expr"])
            out.append(PanelQuery(panel["title"], unit, target["refId"], expr))
    return out


def adapter_queries(namespace: str) -> dict[str, list[str]]:
    """prometheus-adapter's rules (the HPAs' metrics): name -> [series query, metrics query].

    The metrics query's templates are filled as prometheus-adapter fills them for one namespace's
    pods: ``<<.LabelMatchers>>`` selects the namespace, ``<<.GroupBy>>`` is ``pod``.
    """
    config = yaml.safe_load(yaml.safe_load(ADAPTER_RULES.read_text())["data"]["config.yaml"])
    out = {}
    for rule in config["rules"]:
        metrics = rule["metricsQuery"].replace("<<.LabelMatchers>>", f'namespace="{namespace}"')
        out[rule["name"]["as"]] = [rule["seriesQuery"], metrics.replace("<<.GroupBy>>", "pod")]
    return out


@dataclass(frozen=True)
class ScrapeJob:
    """A static scrape job; ``labels`` are what the Kubernetes service discovery would add."""

    name: str
    targets: list[str]
    labels: dict[str, str] = field(default_factory=dict)


def _config(jobs: list[ScrapeJob], rule_files: list[Path]) -> dict[str, Any]:
    # 1 s scrapes and evaluations: a test of ~20 s still gives every rate() many samples.
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(path) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": job.name,
                "static_configs": [{"targets": [target], "labels": labels}
                                   for target, labels in _per_target(job)],
            }
            for job in jobs
        ],
    }


def _per_target(job: ScrapeJob) -> list[tuple[str, dict[str, str]]]:
    """Each target with the job's labels; ``pod`` gets the target's index (``sim-0``, …)."""
    out = []
    for i, target in enumerate(job.targets):
        labels = dict(job.labels)
        if "pod" in labels:
            labels["pod"] = f"{labels['pod']}-{i}"
        out.append((target, labels))
    return out


class PrometheusServer:
    """A private ``prometheus`` process; ``query`` runs PromQL through its HTTP API."""

    def __init__(self, jobs: list[ScrapeJob], rule_files: list[Path]) -> None:
        self.binary = require("prometheus")
        self.workdir = Path(tempfile.mkdtemp(prefix="fg-prometheus-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(_config(jobs, rule_files), sort_keys=False))
        self.config = config
        self.log = self.workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready after {timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/<path>``; the ``data`` of a successful answer, else AssertionError."""
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as err:  # 400/422: a bad query, with Prometheus's reason
            body = json.load(err)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar answer becomes one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "vector":
            return data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        raise AssertionError(f"{expr!r}: unexpected result type {data['resultType']}")

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def values(result: list[dict[str, Any]]) -> list[float]:
    """The sample values of an instant vector."""
    return [float(sample["value"][1]) for sample in result]
