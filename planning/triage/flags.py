"""Feed ``fleetgate advise`` into triage: a lever that names a vLLM flag gets the advised value.

Triage's levers say *which* knob ("an FP8 KV cache (vLLM --kv-cache-dtype fp8)"); advise knows
*by how much* for each pool, from the engines' own flags. ``annotate`` appends advise's verdict to
every lever whose text names a flag advise judged, so the two commands never disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from planning.advise.model import Advice
from planning.advise.render import value
from planning.triage.model import Lever

_FLAG = re.compile(r"--[a-z][a-z0-9-]+")


def annotate(levers: Sequence[Lever], advice: Mapping[str, Sequence[Advice]]) -> list[Lever]:
    """``levers`` with, per named flag, what advise says on each pool (``pool -> rows``)."""
    out = []
    for lever in levers:
        notes = []
        for flag in dict.fromkeys(_FLAG.findall(lever.action + " " + lever.why)):
            for pool, rows in advice.items():
                row = next((r for r in rows if r.flag == flag), None)
                if row is None:
                    continue
                if row.kind == "change":
                    notes.append(
                        f"pool {pool}: {flag} {value(row.current)} -> {value(row.advised)}"
                    )
                else:
                    notes.append(f"pool {pool}: {flag} {value(row.current)} ({row.kind})")
        if notes:
            lever = Lever(
                lever.category, lever.action, f"{lever.why}. fleetgate advise: " + "; ".join(notes)
            )
        out.append(lever)
    return out
