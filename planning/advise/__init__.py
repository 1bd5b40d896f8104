"""Engine-flag advice: which vLLM flag to change, by how much and why, from what a pool serves.

``advise(PoolSnapshot) -> list[Advice]`` is pure (``decide.py``); one module per rule family
(``context``, ``memory``, ``batch``, ``adapters``, ``parallel``, ``features``); ``snapshot``
reads a JSON/YAML snapshot, ``live`` a running gateway or engines, ``verify`` replays the traffic
through the simulator with today's and the advised flags. ``fleetgate advise`` wires them up.
"""

from __future__ import annotations

from planning.advise.decide import FLAGS, advise, changes
from planning.advise.model import (
    Advice,
    AdviceError,
    EngineFlags,
    Measurements,
    Percentiles,
    PoolSnapshot,
)

__all__ = [
    "FLAGS",
    "Advice",
    "AdviceError",
    "EngineFlags",
    "Measurements",
    "Percentiles",
    "PoolSnapshot",
    "advise",
    "changes",
]
