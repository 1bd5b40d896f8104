"""LoRA residency of the simulated engine: slots, host cache, load times, eviction order."""

from __future__ import annotations

import pytest

from replica.sim.lora import LoraSlots

H2D_GBPS, STORAGE_GBPS, SIZE_MB = 10.0, 1.0, 200.0
FROM_HOST = SIZE_MB * 1e6 / (H2D_GBPS * 1e9)
FROM_STORAGE = SIZE_MB * 1e6 / (STORAGE_GBPS * 1e9)


def slots(max_loras: int = 2, max_cpu_loras: int = 3) -> LoraSlots:
    lora = LoraSlots(max_loras, max_cpu_loras, H2D_GBPS, STORAGE_GBPS, SIZE_MB)
    for name in "abcde":
        lora.register(name)
    return lora


@pytest.mark.parametrize(
    ("history", "name", "expected_s"),
    [
        ([], "a", FROM_STORAGE + FROM_HOST),  # cold: storage, then host -> device
        (["a"], "a", 0.0),  # already in a slot
        (["a", "b", "c"], "a", FROM_HOST),  # evicted from its slot, still in host memory
        (["a", "b", "c", "d"], "a", FROM_STORAGE + FROM_HOST),  # also evicted from host
    ],
)
def test_activation_cost_depends_on_where_the_adapter_is(
    history: list[str], name: str, expected_s: float
) -> None:
    lora = slots()
    for other in history:
        lora.activate(other, in_use=())
    assert lora.activate(name, in_use=()) == pytest.approx(expected_s)


def test_slot_eviction_skips_adapters_in_use_and_takes_the_least_recent() -> None:
    lora = slots()
    lora.activate("a", ())
    lora.activate("b", ())
    assert lora.can_activate("c", in_use={"b"})
    lora.activate("c", in_use={"a"})  # a is busy: b goes although a is older
    assert lora.on_gpu() == ["a", "c"]
    assert not lora.can_activate("d", in_use={"a", "c"})
    with pytest.raises(RuntimeError, match="no free LoRA slot"):
        lora.activate("d", in_use={"a", "c"})


def test_host_cache_keeps_gpu_adapters_and_evicts_lru_others() -> None:
    lora = slots(max_loras=1, max_cpu_loras=2)
    lora.activate("a", ())
    lora.activate("b", ())  # a leaves the slot, stays in host
    lora.activate("c", ())  # host is full (a, b): a is least recently used and not in a slot
    assert lora.on_gpu() == ["c"]
    assert lora.in_host() == ["b", "c"]


def test_touch_refreshes_recency() -> None:
    lora = slots()
    lora.activate("a", ())
    lora.activate("b", ())
    lora.touch("a")
    lora.activate("c", ())
    assert lora.on_gpu() == ["a", "c"]


@pytest.mark.parametrize(
    ("args", "message"),
    [((2, 1, 1.0, 1.0, 1.0), "max_cpu_loras"), ((1, 1, 0.0, 1.0, 1.0), "bandwidths")],
)
def test_bad_construction_is_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoraSlots(*args)


def test_registration_refused_when_lora_is_disabled() -> None:
    with pytest.raises(ValueError, match="LoRA is disabled"):
        LoraSlots(0, 0, 1.0, 1.0, 1.0).register("a")


def test_unregister_unknown_adapter_is_an_error() -> None:
    with pytest.raises(KeyError, match="not loaded"):
        slots().unregister("zzz")
