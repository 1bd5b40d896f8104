"""The alert rules under a real promtool: they parse, and each alert's unit tests pass.

The rules live in a Prometheus Operator manifest (deploy/base/prometheus-rules.yaml); promtool
reads plain rules files, so its ``spec.groups`` are written to one beside copies of the unit
tests (deploy/prometheus/tests/*.test.yaml), which name it ``fleetgate-rules.yaml``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.integration.prometheus_support import RULE_TESTS, require, rules, write_rules_file


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require("promtool"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _test_files() -> list[Path]:
    return sorted(RULE_TESTS.glob("*.test.yaml"))


def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    rules_file = write_rules_file(tmp_path)
    done = _promtool("check", "rules", rules_file.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    write_rules_file(tmp_path)
    for path in _test_files():
        shutil.copy(path, tmp_path / path.name)
    done = _promtool("test", "rules", *(p.name for p in _test_files()), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _cases() -> dict[str, dict[str, int]]:
    """Alert name -> how many unit-test evaluations expect it firing and silent."""
    cases: dict[str, dict[str, int]] = {}
    for path in _test_files():
        for group in yaml.safe_load(path.read_text())["tests"]:
            for check in group.get("alert_rule_test", []):
                kind = "firing" if check.get("exp_alerts") else "silent"
                counts = cases.setdefault(check["alertname"], {"firing": 0, "silent": 0})
                counts[kind] += 1
    return cases


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    alerts = [rule["alert"] for rule in rules() if "alert" in rule]
    assert alerts, "no alerts found in the rules"
    cases = _cases()
    missing = {
        alert: kind
        for alert in alerts
        for kind in ("firing", "silent")
        if not cases.get(alert, {}).get(kind)
    }
    assert not missing, f"alerts without a unit test where they are {missing}"
    unknown = sorted(set(cases) - set(alerts))
    assert not unknown, f"unit tests for alerts that do not exist: {unknown}"
