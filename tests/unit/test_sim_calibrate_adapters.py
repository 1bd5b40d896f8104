"""Adapter load calibration: the two stages as bandwidths, and ``--adapter`` parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from planning.calibrate.adapters import (
    AdapterLoad,
    adapter_size_bytes,
    fit_adapters,
    parse_adapter,
)


def _load(load_s: float, slot_s: float | None, size: int = 50_000_000) -> AdapterLoad:
    return AdapterLoad("a", size, load_s, slot_s)


def test_the_slot_stage_is_split_off_the_load_call() -> None:
    # 50 MB: load call 0.35 s = storage 0.25 s (0.2 GB/s) + slot 0.1 s (0.5 GB/s).
    fit = fit_adapters([_load(0.35, 0.1), _load(0.36, 0.1), _load(0.34, 0.11)])
    assert fit.size_mb == pytest.approx(50.0)
    assert fit.storage_gbps == pytest.approx(0.05 / 0.25)
    assert fit.h2d_gbps == pytest.approx(0.05 / 0.1)
    assert "0.2 GB/s" in fit.table() and "0.5 GB/s" in fit.table()


@pytest.mark.parametrize(
    "slot_s", [None, 0.001, 0.5], ids=["no room in host", "under the noise", "over the load call"]
)
def test_without_a_clean_slot_stage_the_whole_load_is_storage(slot_s: float | None) -> None:
    fit = fit_adapters([_load(0.4, slot_s)])
    assert fit.h2d_gbps is None
    assert fit.storage_gbps == pytest.approx(0.05 / 0.4)
    assert "not fitted" in fit.table()


def test_an_adapter_is_sized_from_its_files(tmp_path: Path) -> None:
    adapter = tmp_path / "sql"
    (adapter / "sub").mkdir(parents=True)
    (adapter / "adapter_config.json").write_bytes(b"x" * 100)
    (adapter / "sub" / "weights.bin").write_bytes(b"x" * 900)
    assert adapter_size_bytes(adapter) == 1000
    spec = parse_adapter(f"sql={adapter}")
    assert (spec.name, spec.path, spec.size_bytes) == ("sql", str(adapter), 1000)


@pytest.mark.parametrize(
    ("text", "message"),
    [("sql", "NAME=PATH"), ("=/x", "NAME=PATH"), ("sql=/no/such/dir", "not readable here")],
)
def test_a_bad_adapter_argument_says_how_to_fix_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_adapter(text)


def test_an_empty_adapter_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty"):
        parse_adapter(f"e={tmp_path / 'empty'}")
