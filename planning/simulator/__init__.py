"""The discrete-event fleet simulator: replay a trace through the real routing policies.

Virtual time, N ``replica.sim`` engine models, the real ``routing.RoutingEngine`` with a
``MemoryBlockIndex`` fed by the engines' KV events and the router's own speculative inserts.
``fleetgate simulate`` is its command line; ``docs/simulate.md`` explains the model.
"""

from planning.simulator.adapters import AdapterMix, parse_adapter_spec
from planning.simulator.api import SimulationReport, engine_config_for, simulate
from planning.simulator.ceilings import Ceilings, hit_rate_ceilings
from planning.simulator.config import SimulationConfig, TraceRequest, prepare_requests
from planning.simulator.summary import JSON_FIELDS, PolicySummary

__all__ = [
    "JSON_FIELDS",
    "AdapterMix",
    "Ceilings",
    "PolicySummary",
    "SimulationConfig",
    "SimulationReport",
    "TraceRequest",
    "engine_config_for",
    "hit_rate_ceilings",
    "parse_adapter_spec",
    "prepare_requests",
    "simulate",
]
