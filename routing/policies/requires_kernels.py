"""``requires-kernels``: keep only replicas whose engine runs the kernel plugins a route needs.

A replica's ``kernel_plugins`` (module -> version) is what its vLLM plugin recorded as loaded in
*every* engine process, as read by its agent (docs/vllm-plugin.md). A route whose requests must
run on a particular kernel (a numerics-sensitive tenant during a roll-out, a benchmark, a canary
of a new kernel version) lists it here; replicas without it are filtered out, and the decision's
explanation says so (``filtered_out_by``). If no replica qualifies the request fails with "no
replica available" rather than silently running elsewhere: that is what *require* means.

Parameters: ``kernels``, a list of ``module`` (any version) or ``module==version`` (exactly
that version), e.g. ``["replica.kernels.vllm_plugin==0.1.0"]``. An empty list requires nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

from pydantic import field_validator

from routing.contracts import RoutingRequest
from routing.policies.base import Plugin, PluginKind, PluginParams
from routing.state import ReplicaState

__all__ = ["RequiresKernelsFilter", "parse_requirement"]

#: A dotted Python import path, and a version as the plugin reports it (``__version__``).
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_VERSION = re.compile(r"[\w.+!-]+")


def parse_requirement(spec: str) -> tuple[str, str | None]:
    """``"mod==1.2"`` -> ``("mod", "1.2")``; ``"mod"`` -> ``("mod", None)``."""
    module, sep, version = (part.strip() for part in spec.partition("=="))
    if not _MODULE.fullmatch(module) or (sep and not _VERSION.fullmatch(version)):
        raise ValueError(f"{spec!r} is not 'module' or 'module==version'")
    return module, (version if sep else None)


class RequiresKernelsFilter(Plugin):
    """Drops replicas that have not loaded every required kernel plugin (at its version)."""

    type_name: ClassVar[str] = "requires-kernels"
    kind: ClassVar[PluginKind] = "filter"

    class Params(PluginParams):
        #: ``module`` or ``module==version`` strings; every one must be loaded on the replica.
        kernels: tuple[str, ...] = ()

        @field_validator("kernels")
        @classmethod
        def _valid(cls, value: tuple[str, ...]) -> tuple[str, ...]:
            for spec in value:
                parse_requirement(spec)
            return value

    def __init__(self, params: PluginParams | None = None, *, name: str | None = None) -> None:
        super().__init__(params, name=name)
        assert isinstance(self.params, RequiresKernelsFilter.Params)
        self._required = [parse_requirement(spec) for spec in self.params.kernels]

    def satisfied_by(self, replica: ReplicaState) -> bool:
        """True if ``replica`` runs every required kernel plugin (and version, where given)."""
        loaded = replica.kernel_plugins
        return all(
            module in loaded and (version is None or loaded[module] == version)
            for module, version in self._required
        )

    def filter(
        self, request: RoutingRequest, replicas: Sequence[ReplicaState]
    ) -> list[ReplicaState]:
        """The replicas that have loaded every required kernel plugin."""
        return [r for r in replicas if self.satisfied_by(r)]
