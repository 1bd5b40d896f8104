"""Turning one chaos run's records and samples into per-fault results, a page and timelines.

Definitions (also written on the page):

- *failed before first byte*: the client got no ``200`` (an error status or a dropped
  connection before the response headers). Must be 0 while any replica is up (every fault here
  leaves at least one up). Requests that were in flight on a gateway the fault killed are
  counted apart (*lost with the gateway*): they die with the process that held them.
- *broken mid-stream*: ``200`` received, then the body ended early (no ``data: [DONE]``, a cut
  JSON body). Allowed only on the replica the fault killed.
- *time to detect*: from the injection to the first monitor sample showing the fault's effect
  (the replica unrouted on a gateway, at least 80 % of a gateway's decisions over 1 s made on
  load alone, the gateway not answering; for the slow replica, its share of traffic falling
  below half its baseline).
- *time to recover*: from the heal to the first moment the fleet is steady again (both gateways
  answer and route to every replica, under 80 % degraded, every agent up, engine up, index clean),
  the fault's own condition holds (the restarted replica or gateway served a request) and no
  request started after it failed.
- *stale entries*: index entries a lookup would return for a replica whose engine does not hold
  the block (compared with a second KV-event subscriber per engine); counted when they persist
  over two reads 0.5 s apart, so an event in flight between engine and Redis is not counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.chaos_faults import Fault, FleetState, ReplicaKilled, ReplicaSlow
from bench.chaos_fleet import Fleet
from bench.chaos_observe import (
    BROKEN_MID_STREAM,
    FAILED_BEFORE_FIRST_BYTE,
    OK,
    AgentSample,
    GatewaySample,
    IndexSnapshot,
    RequestRecord,
)

#: Width of the windows the slow-replica detection compares traffic shares over.
SHARE_WINDOW_S = 2.0


@dataclass
class FaultWindow:
    """When one fault's phases happened (benchmark clock) and the index reads taken after."""

    fault: Fault
    start: float
    inject: float = 0.0
    heal: float = 0.0
    end: float = 0.0
    #: Persistent stale-entry counts read after the heal: (time, count, the second read).
    stale_reads: list[tuple[float, int, IndexSnapshot]] = field(default_factory=list)
    stale_max_during: int = 0
    steady_before: bool = True
    #: Engine-held blocks the index lacked just before the injection (earlier faults' share).
    missing_before: int | None = None


@dataclass
class FaultResult:
    name: str
    title: str
    how: str
    sent: int
    succeeded: int
    failed_before_first_byte: int
    broken_mid_stream: int
    broken_elsewhere: int
    lost_with_gateway: int
    failovers: int
    detect_s: float | None
    recover_s: float | None
    stale_during_max: int
    stale_after: int | None
    stale_zero_s: float | None
    missing_after: int | None
    missing_before: int | None
    p50_ms: float | None
    p99_ms: float | None
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def invariants_hold(self) -> bool:
        return (self.failed_before_first_byte == 0 and self.broken_elsewhere == 0
                and self.stale_zero_s is not None and self.recover_s is not None)


# --------------------------------------------------------------------------- fleet states


def fleet_states(gateway_samples: Sequence[GatewaySample], agent_samples: Sequence[AgentSample],
                 start: float, end: float, step: float) -> list[FleetState]:
    """The latest sample of every gateway and agent at each ``step`` from ``start`` to ``end``."""
    gws = sorted(gateway_samples, key=lambda s: s.t)
    ags = sorted(agent_samples, key=lambda s: s.t)
    states: list[FleetState] = []
    history: dict[int, list[GatewaySample]] = {}
    latest_ag: dict[str, AgentSample] = {}
    gi = ai = 0
    t = start
    for _ in range(100_000):
        if t > end:
            break
        while gi < len(gws) and gws[gi].t <= t:
            history.setdefault(gws[gi].gateway, []).append(gws[gi])
            gi += 1
        while ai < len(ags) and ags[ai].t <= t:
            latest_ag[ags[ai].replica] = ags[ai]
            ai += 1
        latest = [history[g][-1] for g in sorted(history)]
        trouble = [_index_trouble(history[g], start) for g in sorted(history)]
        states.append(FleetState(t, latest, list(latest_ag.values()), trouble))
        t += step
    return states


#: Share of a gateway's requests over ``TROUBLE_SPAN_S`` decided on load alone (the index failed
#: or missed its 20 ms budget) from which the index counts as in trouble. Some lookups miss the
#: budget in steady state on a busy 2-core machine too (see the page); a Redis fault makes
#: nearly all of them miss.
TROUBLE_SHARE = 0.8
TROUBLE_SPAN_S = 1.0


def _index_trouble(history: list[GatewaySample], since: float) -> bool:
    """Over the last ``TROUBLE_SPAN_S`` of one gateway's samples, all taken after ``since``
    (a fault's effect is never judged on samples from before it), at least ``TROUBLE_SHARE``
    of its requests were degraded. A restarted gateway's counters start again from 0: a
    decrease is not trouble."""
    after = history[-1]
    if not after.up or after.t <= since:
        return False
    before = next((s for s in reversed(history) if s.t <= after.t - TROUBLE_SPAN_S), None)
    if before is None or not before.up or before.t < since - TROUBLE_SPAN_S:
        return False
    degraded = after.degraded_total - before.degraded_total
    requests = after.requests_total - before.requests_total
    return degraded > 0 and degraded >= TROUBLE_SHARE * max(1.0, requests)


def steady(state: FleetState, fleet: Fleet) -> bool:
    """Everything answers, every gateway routes to every replica, nothing is degraded."""
    ids = {r.replica_id for r in fleet.replicas}
    if len(state.gateways) < len(fleet.gateways) or any(state.index_trouble):
        return False
    for sample in state.gateways:
        if not sample.up:
            return False
        for rid in ids:
            view = sample.replicas.get(rid)
            if view is None or not view.healthy or view.circuit != "closed":
                return False
    if len(state.agents) < len(fleet.replicas):
        return False
    return all(a.up and a.engine_up and not a.dirty for a in state.agents)


# --------------------------------------------------------------------------- one fault


def _share(records: Sequence[RequestRecord], replica_id: str, start: float, end: float) -> float:
    served = [r for r in records if start <= r.start < end and r.served_by]
    if not served:
        return 0.0
    return sum(r.served_by == replica_id for r in served) / len(served)


def _slow_detect_recover(fault: ReplicaSlow, window: FaultWindow, fleet: Fleet,
                         records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """Detection: the slow replica's share of requests falls below half its warm-up share;
    recovery: after the heal it is back above half."""
    rid = fault.replica_id(fleet)
    baseline = _share(records, rid, window.start, window.inject)
    fault.baseline_share = baseline
    detect = recover = None
    t = window.inject
    while t + SHARE_WINDOW_S <= window.heal and baseline > 0:
        if _share(records, rid, t, t + SHARE_WINDOW_S) < baseline / 2:
            detect = t + SHARE_WINDOW_S
            break
        t += 0.5
    t = window.heal
    while t + SHARE_WINDOW_S <= window.end and baseline > 0:
        if _share(records, rid, t, t + SHARE_WINDOW_S) >= baseline / 2:
            recover = t
            break
        t += 0.5
    return detect, recover


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def analyse(window: FaultWindow, fleet: Fleet, records: Sequence[RequestRecord],
            gateway_samples: Sequence[GatewaySample], agent_samples: Sequence[AgentSample],
            step: float) -> FaultResult:
    fault = window.fault
    mine = [r for r in records if window.start <= r.start < window.end]
    target_rid = (fleet.replicas[fault.target_replica].replica_id
                  if fault.target_replica is not None else None)
    lost = [r for r in mine if _lost_with_gateway(r, fault, window)]
    failed = [r for r in mine if r.outcome == FAILED_BEFORE_FIRST_BYTE and r not in lost]
    broken = [r for r in mine if r.outcome == BROKEN_MID_STREAM and r not in lost]
    broken_elsewhere = [r for r in broken if target_rid is None or r.served_by != target_rid]
    states = fleet_states(gateway_samples, agent_samples, window.inject, window.end, step)
    if isinstance(fault, ReplicaSlow):
        detect_t, extra_t = _slow_detect_recover(fault, window, fleet, records)
    else:
        detect_t = next((s.t for s in states if s.t > window.inject and fault.detected(s, fleet)),
                        None)
        extra_t = fault.recovered_extra(list(records), window.heal, fleet)
    steady_t = next((s.t for s in states if s.t >= window.heal and steady(s, fleet)), None)
    bad_after = [r.start for r in mine if r.start >= window.heal and r.outcome != OK]
    recover_t = None
    if steady_t is not None and extra_t is not None:
        recover_t = max([steady_t, extra_t, *[t + 1e-3 for t in bad_after]])
    latencies = [1000 * (r.end - r.start) for r in mine if r.outcome == OK
                 and r.end is not None and window.inject <= r.start < window.heal]
    result = FaultResult(
        name=fault.name, title=fault.title, how=fault.how, sent=len(mine),
        succeeded=sum(r.outcome == OK for r in mine),
        failed_before_first_byte=len(failed), broken_mid_stream=len(broken),
        broken_elsewhere=len(broken_elsewhere), lost_with_gateway=len(lost),
        failovers=sum(r.failover for r in mine),
        detect_s=None if detect_t is None else max(0.0, detect_t - window.inject),
        recover_s=None if recover_t is None else max(0.0, recover_t - window.heal),
        stale_during_max=window.stale_max_during,
        stale_after=None, stale_zero_s=None, missing_after=None,
        missing_before=window.missing_before,
        p50_ms=_percentile(latencies, 0.5), p99_ms=_percentile(latencies, 0.99),
        errors=_top_errors(failed + broken + lost),
    )
    _stale_figures(result, window, recover_t)
    _notes(result, window, fault, target_rid, broken)
    if isinstance(fault, ReplicaKilled) and target_rid is not None and steady_t is not None:
        result.notes.append(_inflight_when_steady(gateway_samples, target_rid, steady_t))
    return result


def _lost_with_gateway(record: RequestRecord, fault: Fault, window: FaultWindow) -> bool:
    """In flight on the gateway the fault killed, when it was killed."""
    if fault.target_gateway is None or record.outcome == OK:
        return False
    return (record.gateway == fault.target_gateway and record.start <= window.inject
            and (record.end or window.end) >= window.inject)


def _stale_figures(result: FaultResult, window: FaultWindow, recover_t: float | None) -> None:
    reads = window.stale_reads
    if not reads:
        result.notes.append("the index could not be read after the heal")
        return
    after = [r for r in reads if recover_t is None or r[0] >= recover_t] or reads[-1:]
    result.stale_after = after[0][1]
    result.missing_after = after[0][2].missing
    # Zero from some read on, to the last one.
    zero_from = None
    for t, count, _snap in reads:
        if count == 0 and zero_from is None:
            zero_from = t
        elif count:
            zero_from = None
    result.stale_zero_s = None if zero_from is None else max(0.0, zero_from - window.heal)


def _top_errors(records: Sequence[RequestRecord], n: int = 3) -> list[str]:
    counts = Counter((r.status, r.error.split("\n")[0][:120]) for r in records)
    return [f"{count}× HTTP {status or '-'}: {error}" for (status, error), count
            in counts.most_common(n)]


def _inflight_when_steady(samples: Sequence[GatewaySample], replica_id: str,
                          steady_t: float) -> str:
    """What the gateways counted in flight on the restarted replica as the fleet became steady:
    a count left over from the killed engine's requests would hold it back from routing."""
    counts = [s.replicas[replica_id].inflight for s in samples
              if s.up and replica_id in s.replicas and steady_t - 0.5 <= s.t <= steady_t + 0.5]
    return (f"in flight on the restarted replica at the gateways when steady: "
            f"{max(counts) if counts else 'not sampled'}")


def _notes(result: FaultResult, window: FaultWindow, fault: Fault, target_rid: str | None,
           broken: list[RequestRecord]) -> None:
    if not window.steady_before:
        result.notes.append("the fleet was not steady when the fault was injected")
    if result.detect_s is None:
        result.notes.append("no monitored signal showed this fault (not detected)")
    if result.recover_s is None:
        result.notes.append("not recovered within the observation window")
    if target_rid is not None and broken:
        unknown = sum(r.served_by is None for r in broken)
        if unknown:
            result.notes.append(f"{unknown} broken request(s) with no served_by in the "
                                "decision logs (counted as elsewhere)")
    if isinstance(fault, ReplicaSlow):
        result.notes.append(f"the slow replica's warm-up traffic share: "
                            f"{fault.baseline_share:.0%}")


# --------------------------------------------------------------------------- page


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def _n(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def render(results: Sequence[FaultResult], header: Sequence[str], plots: dict[str, Path],
           page_path: Path) -> str:
    lines = list(header)
    lines += [
        "",
        "| fault | sent | ok | failed before 1st byte | broken mid-stream (on killed / "
        "elsewhere) | lost with gateway | LB failovers | detect | recover | stale max during "
        "| stale after recovery | stale → 0 after heal | p50 / p99 ms (fault) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.title} | {r.sent:,} | {r.succeeded:,} | **{r.failed_before_first_byte}** | "
            f"{r.broken_mid_stream - r.broken_elsewhere} / {r.broken_elsewhere} | "
            f"{r.lost_with_gateway} | {r.failovers} | {_s(r.detect_s)} | {_s(r.recover_s)} | "
            f"{_n(r.stale_during_max)} | {_n(r.stale_after)} | {_s(r.stale_zero_s)} | "
            f"{_ms(r.p50_ms)} / {_ms(r.p99_ms)} |"
        )
    for r in results:
        lines += ["", f"### {r.title}", "", f"How: {r.how}.", ""]
        lines += [
            "| | |", "|---|---|",
            f"| requests sent / succeeded | {r.sent:,} / {r.succeeded:,} |",
            f"| failed before first byte | {r.failed_before_first_byte} |",
            f"| broken mid-stream (on the killed replica / elsewhere) | "
            f"{r.broken_mid_stream - r.broken_elsewhere} / {r.broken_elsewhere} |",
            f"| lost with the killed gateway | {r.lost_with_gateway} |",
            f"| load-balancer failovers (refused connection, resent) | {r.failovers} |",
            f"| time to detect | {_s(r.detect_s)} |",
            f"| time to recover | {_s(r.recover_s)} |",
            f"| stale index entries: max during the fault / after recovery | "
            f"{_n(r.stale_during_max)} / {_n(r.stale_after)} |",
            f"| stale entries reached 0 (after the heal) | {_s(r.stale_zero_s)} |",
            f"| engine-held blocks the index lacks (cold, not wrong): before the fault / "
            f"after recovery | {_n(r.missing_before)} / {_n(r.missing_after)} |",
            f"| latency of OK requests during the fault, p50 / p99 | "
            f"{_ms(r.p50_ms)} / {_ms(r.p99_ms)} ms |",
        ]
        if r.errors:
            lines += ["", "Failures: " + "; ".join(f"`{e}`" for e in r.errors) + "."]
        if r.notes:
            lines += ["", "Notes: " + "; ".join(r.notes) + "."]
        if r.name in plots:
            rel = plots[r.name].relative_to(page_path.parent) if plots[r.name].is_relative_to(
                page_path.parent) else plots[r.name]
            lines += ["", f"![{r.title}]({rel})"]
    return "\n".join(lines) + "\n"


def plot_window(window: FaultWindow, records: Sequence[RequestRecord], path: Path) -> None:
    """Requests per second by outcome, with the injection and heal marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in records if window.start <= r.start < window.end]
    seconds = max(1, int(window.end - window.start))  # whole seconds: no partial last bucket
    buckets = {kind: [0] * seconds for kind in (OK, FAILED_BEFORE_FIRST_BYTE, BROKEN_MID_STREAM)}
    for r in mine:
        kind = r.outcome if r.outcome in buckets else FAILED_BEFORE_FIRST_BYTE
        second = int(r.start - window.start)
        if second < seconds:
            buckets[kind][second] += 1
    xs = list(range(seconds))
    fig, ax = plt.subplots(figsize=(8, 2.8))
    ax.plot(xs, buckets[OK], label="ok /s", color="tab:green")
    ax.plot(xs, buckets[FAILED_BEFORE_FIRST_BYTE], label="failed before 1st byte /s",
            color="tab:red")
    ax.plot(xs, buckets[BROKEN_MID_STREAM], label="broken mid-stream /s", color="tab:orange")
    ax.axvspan(window.inject - window.start, window.heal - window.start, color="grey", alpha=0.2,
               label="fault")
    ax.set_xlabel("seconds (by request start)")
    ax.set_title(window.fault.title)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
