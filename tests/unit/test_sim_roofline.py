"""Roofline formulas, profiles and engine-config validation of the simulated replica."""

from __future__ import annotations

import pytest

from replica.sim import profiles
from replica.sim.engine import EngineConfig
from replica.sim.profiles import ProfileError, load_hardware, load_model, preset_names
from replica.sim.roofline import Roofline


def roofline(hw: str, model: str, wd: str = "bf16", kd: str = "bf16", tp: int = 1) -> Roofline:
    return Roofline(load_hardware(hw), load_model(model), wd, kd, 0.7, 0.4, tp)


@pytest.mark.parametrize(
    ("kv_dtype", "expected"),
    [("bf16", 2 * 32 * 8 * 128 * 2), ("fp8", 2 * 32 * 8 * 128 * 1)],
)
def test_kv_bytes_per_token(kv_dtype: str, expected: int) -> None:
    assert roofline("h100-sxm", "llama3-8b", kd=kv_dtype).kv_bytes_per_token == expected


@pytest.mark.parametrize(
    ("hw", "weight_dtype", "tflops", "weight_gb"),
    [
        ("h100-sxm", "bf16", 989, 16.06),
        ("h100-sxm", "fp8", 1979, 8.03),  # W8A8 on FP8 tensor cores
        ("h100-sxm", "int4", 989, 4.015),  # W4A16 dequantises and computes in 16-bit
        ("a100-80gb", "fp8", 312, 8.03),  # no FP8 tensor cores: W8A16
        ("l4", "fp8", 242, 8.03),
    ],
)
def test_prefill_flops_follow_the_compute_dtype(
    hw: str, weight_dtype: str, tflops: float, weight_gb: float
) -> None:
    r = roofline(hw, "llama3-8b", wd=weight_dtype)
    assert r.weight_bytes / 1e9 == pytest.approx(weight_gb)
    assert r.prefill_s(1000) == pytest.approx(2 * 8.03e9 * 1000 / (tflops * 1e12 * 0.4))


def test_decode_reads_weights_and_kv_at_effective_bandwidth() -> None:
    r = roofline("h100-sxm", "llama3-8b")
    context = 32 * 6150
    expected = (8.03e9 * 2 + context * 131072) / (3.35e12 * 0.7)
    assert r.decode_s(context) == pytest.approx(expected)


@pytest.mark.parametrize(("tokens", "context"), [(1, 0), (32, 200_000), (4096, 0), (512, 9000)])
def test_mixed_step_is_the_slower_of_compute_and_memory(tokens: int, context: int) -> None:
    r = roofline("h100-sxm", "llama3-8b")
    assert r.step_s(tokens, context) == max(r.prefill_s(tokens), r.decode_s(context))


def test_tensor_parallel_scales_memory_bandwidth_and_flops() -> None:
    one, four = roofline("h100-sxm", "llama3-70b"), roofline("h100-sxm", "llama3-70b", tp=4)
    assert four.hbm_bytes == 4 * one.hbm_bytes
    assert four.decode_s(0) == pytest.approx(one.decode_s(0) / 4)
    assert four.prefill_s(100) == pytest.approx(one.prefill_s(100) / 4)


def test_kv_blocks_from_memory_left_after_weights() -> None:
    config = EngineConfig.from_profile("h100-llama3-8b")
    expected = int((80e9 * 0.9 - 8.03e9 * 2) // (16 * 131072))
    assert config.num_gpu_blocks == expected


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds(name: str) -> None:
    config = EngineConfig.from_profile(name)
    assert config.num_gpu_blocks > 0
    assert config.replica_price_per_hour > 0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
        ({"weight_dtype": "int3"}, "weight_dtype"),
        ({"kv_dtype": "int4"}, "kv_dtype"),
        ({"efficiency": 1.5}, "efficiency"),
        ({"max_loras": 5, "max_cpu_loras": 4}, "max_cpu_loras (4) must be >= max_loras (5)"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"model": "llama3-70b"}, "no room for the KV cache"),
        ({"enable_chunked_prefill": False}, "max_num_batched_tokens"),
        ({"bogus": 1}, "unknown setting 'bogus'"),
        ({"hardware": "tpu"}, "unknown profile 'tpu'"),
    ],
)
def test_bad_config_is_refused_with_the_setting_named(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig.from_profile("h100-llama3-8b", **overrides)


def test_unknown_preset_is_refused() -> None:
    with pytest.raises(ProfileError, match="unknown preset 'nope'"):
        EngineConfig.from_profile("nope")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"params": 1e9, "layers": 2, "kv_heads": 1, "head_dim": 8, "colour": 1},
            "colour: unknown",
        ),
        ({"params": "8e9", "layers": 2, "kv_heads": 1, "head_dim": 8}, "params: must be a number"),
        ({"layers": 2, "kv_heads": 1, "head_dim": 8}, "params"),
    ],
)
def test_profile_yaml_is_decoded_strictly(
    monkeypatch: pytest.MonkeyPatch, entry: dict, message: str
) -> None:
    monkeypatch.setattr(profiles, "_read", lambda _filename: {"m": entry})
    with pytest.raises(ProfileError, match=message):
        profiles.load_model("m")


def test_config_needs_profile_objects_not_names() -> None:
    with pytest.raises(TypeError, match="from_profile"):
        EngineConfig(hardware="h100-sxm", model="llama3-8b")  # type: ignore[arg-type]
