"""The replica agent (``fleetgate agent``): vLLM KV events + metrics -> block index + fleet store.

Public API::

    from replica.agent import AgentConfig, ReplicaAgent

    async with ReplicaAgent(AgentConfig(replica_id="r0", engine_url="http://127.0.0.1:8000",
                                        kv_events_endpoint="tcp://127.0.0.1:5557",
                                        index_url="redis://127.0.0.1:6379/0")) as agent:
        ...

See docs/agent.md.
"""

from replica.agent.agent import ReplicaAgent
from replica.agent.config import AgentConfig
from replica.agent.ingest import EpochClock, EventApplier, cache_salt_of
from replica.agent.metrics import AgentMetrics

__all__ = [
    "AgentConfig",
    "AgentMetrics",
    "EpochClock",
    "EventApplier",
    "ReplicaAgent",
    "cache_salt_of",
]
