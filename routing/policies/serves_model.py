"""``serves-model``: keep only healthy replicas that serve the request's base model and can
fit it.

The engine always runs this filter first, whatever the profile says: routing to an unhealthy
replica, to one without the base model, or to one whose context (``--max-model-len``) is shorter
than the prompt plus the output asked for, can only fail (vLLM answers 400). The context test
drops a replica only while another can take the request: where none can (a prompt longer than
every context, or a token count that is only the gateway's estimate), the engine's own 400 says
so. A request for an adapter skips replicas with no LoRA slot (``max_loras`` 0) while another
may have one. Adapter residency is not checked here (any replica with a slot can load the
adapter); scorers weigh adapter affinity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind
from routing.state import ReplicaState


class ServesModelFilter(Plugin):
    """Drops unhealthy replicas and replicas that do not serve ``request.model``."""

    type_name: ClassVar[str] = "serves-model"
    kind: ClassVar[PluginKind] = "filter"

    def filter(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> list[ReplicaState]:
        """The replicas that are healthy, serve the request's base model and fit it (where any
        does)."""
        serving = [r for r in replicas if r.healthy and request.model in r.models]
        if request.adapter:
            # A replica with no LoRA slot (vLLM without --enable-lora: declared, or learned
            # from a refused load) can never serve an adapter: in a burst, each request tried
            # every such replica before one that can (the heterogeneous-fleet re-check: 135
            # failed attempts for 30 requests).
            serving = [r for r in serving if r.max_loras != 0] or serving
        fitting = [r for r in serving if fits(request, r)]
        return fitting or serving


def context_needed(request: RoutingRequest) -> int:
    """Tokens the request takes of a context: its prompt and the output it asked for (vLLM
    refuses a prompt plus ``max_tokens`` over ``--max-model-len``; without ``max_tokens`` it
    needs room for one)."""
    return request.prompt_tokens + max(1, request.max_output_tokens or 1)


def fits(request: RoutingRequest, replica: ReplicaState) -> bool:
    """Whether ``replica``'s context takes ``request`` (an unknown context is taken to)."""
    return replica.max_model_len is None or context_needed(request) <= replica.max_model_len
