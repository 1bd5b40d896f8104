"""Static replicas' ids: a bare URL's is its position, a named one's its name; a reload that puts
another engine under an id starts that id afresh and says why (the live index review: removing
the first of three bare URLs renamed the others, and their prefixes went to the wrong engines)."""

from __future__ import annotations

import logging

import pytest

from gateway.policy_view import from_policy
from gateway.replicas import ReplicaRegistry
from routing.config import PolicyError, parse_policy
from routing.types import ReplicaId

POLICY = """
version: 1
replica_pools:
  - name: p
    replicas:
{entries}
models:
  - {{name: base-model, pools: [p]}}
"""


def _policy(*entries: str):  # type: ignore[no-untyped-def]
    return parse_policy(POLICY.format(entries="\n".join(f"      - {e}" for e in entries)))


def test_a_named_replica_keeps_its_id_wherever_it_stands() -> None:
    view = from_policy(_policy("http://a:8000", '{name: east-1, url: "http://b:8000"}'))
    assert {s.replica_id: s.url for s in view.replicas} == {
        "p/0": "http://a:8000",
        "p/east-1": "http://b:8000",
    }
    view = from_policy(_policy('{name: east-1, url: "http://b:8000"}'))
    assert [s.replica_id for s in view.replicas] == ["p/east-1"]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        (("ftp://x",), r"replicas\[0\]: must be an http:// or https:// URL"),
        (("5",), r"replicas\[0\]: must be a URL or a mapping \{name, url\} \(got 5\)"),
        (('{name: a, urll: "http://x"}',), r"replicas\[0\]\.url: required key is missing"),
        (('{name: a, url: "http://x"}', '{name: a, url: "http://y"}'), "the same name"),
        (('"http://x"', '{name: "0", url: "http://y"}'), "another's position"),
        (('"http://x"', '{name: b, url: "http://x"}'), "the same URL twice"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(entries: tuple[str, ...], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        _policy(*entries)


def test_another_engine_under_an_id_starts_afresh_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ReplicaRegistry()
    forgotten: list[ReplicaId] = []
    registry.on_remove.append(forgotten.append)
    registry.set_static(from_policy(_policy("http://a:8000", "http://b:8000")).replicas)
    first = registry.breaker(ReplicaId("p/0"))
    # The first is removed from the list: the second takes its position, and so its id.
    with caplog.at_level(logging.WARNING, logger="gateway.replicas"):
        registry.set_static(from_policy(_policy("http://b:8000")).replicas)
    state = registry.get(ReplicaId("p/0"))
    assert state is not None and state.url == "http://b:8000"
    assert registry.get(ReplicaId("p/1")) is None
    assert registry.breaker(ReplicaId("p/0")) is not first  # nothing carried over
    assert sorted(forgotten) == ["p/0", "p/1"]
    assert "is now http://b:8000 (was http://a:8000)" in caplog.text
    assert "Give static replicas names" in caplog.text
    # The same engine under the same id is kept as it was.
    caplog.clear()
    kept = registry.breaker(ReplicaId("p/0"))
    registry.set_static(from_policy(_policy("http://b:8000")).replicas)
    assert registry.breaker(ReplicaId("p/0")) is kept and not caplog.text


def test_policy_show_writes_bare_urls_back_as_urls() -> None:
    policy = _policy("http://a:8000", '{name: east-1, url: "http://b:8000"}')
    dumped = policy.model_dump(mode="json")["replica_pools"][0]["replicas"]
    assert dumped == ["http://a:8000", {"url": "http://b:8000", "name": "east-1"}]


def test_a_named_replica_that_moves_starts_afresh_without_blaming_positions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = ReplicaRegistry()
    registry.set_static(from_policy(_policy('{name: e1, url: "http://a:8000"}')).replicas)
    with caplog.at_level(logging.WARNING, logger="gateway.replicas"):
        registry.set_static(from_policy(_policy('{name: e1, url: "http://b:8000"}')).replicas)
    state = registry.get(ReplicaId("p/e1"))
    assert state is not None and state.url == "http://b:8000"
    assert "moved to http://b:8000" in caplog.text and "position" not in caplog.text
