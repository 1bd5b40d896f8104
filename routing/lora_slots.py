"""What vLLM's ``vllm:lora_requests_info`` gauge says: GPU LoRA slots and the adapters using them.

The gauge keeps one sample per label set it ever had, its value the time that label set was
set, so the current reading is the sample with the latest value. The gateway's poll (a quick
line scan), the replica agent's scrape and the flag advisor (``prometheus_client``'s parser) read
``/metrics`` their own ways and hand the samples here, so all three read the gauge the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["LORA_INFO_METRIC", "LoraInfo", "latest_lora_info"]

LORA_INFO_METRIC = "vllm:lora_requests_info"


@dataclass(frozen=True)
class LoraInfo:
    """One ``vllm:lora_requests_info`` sample: GPU LoRA slots, and the adapters using them."""

    max_loras: int | None = None
    #: Adapters of running requests (each holds a slot) ...
    running: frozenset[str] = frozenset()
    #: ... and of requests waiting, some of them for a slot.
    waiting: frozenset[str] = frozenset()

    @classmethod
    def from_labels(cls, labels: Mapping[str, str]) -> LoraInfo:
        """From a sample's labels: ``max_lora``, ``running_lora_adapters``,
        ``waiting_lora_adapters``."""
        raw = labels.get("max_lora", "")
        try:
            max_loras: int | None = int(raw)
        except ValueError:
            max_loras = None  # "", "None", or anything else vLLM might print: unknown

        def names(key: str) -> frozenset[str]:
            return frozenset(name for name in labels.get(key, "").split(",") if name)

        return cls(max_loras, names("running_lora_adapters"), names("waiting_lora_adapters"))


def latest_lora_info(samples: Iterable[tuple[Mapping[str, str], float]]) -> LoraInfo | None:
    """The current reading from the gauge's ``(labels, value)`` samples; None without any."""
    latest: tuple[float, Mapping[str, str]] | None = None
    for labels, value in samples:
        if latest is None or value >= latest[0]:
            latest = (value, labels)
    return LoraInfo.from_labels(latest[1]) if latest is not None else None
