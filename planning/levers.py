"""``fleetgate plan levers``: what quantisation, KV dtype, prefix caching and batch size buy.

A roofline table for one GPU serving one model: for each of seven lever settings it gives the
weight and KV memory, whether they fit, prefill-only TTFT, TPOT, throughput and the cost of a
million output tokens. The timing comes from ``replica/sim/roofline.py``, the same functions the
simulated engine steps with, so the table and the simulator never disagree.

Assumptions (see ``docs/levers.md``): every running sequence sits at the average context
``prompt + output/2`` (in steady state sequences are spread evenly over their output), and that one
context sizes both the KV *held* and the KV each decode step *reads*; a shared prefix is *stored*
once but still *read* by every sequence; TTFT is prefill compute only (no queueing), and with the
prefix cache only the unshared tokens are prefilled (the shared prefix is already in the cache,
its one-time prefill is amortised over all requests and left out). GB are decimal (1e9 bytes).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml

from planning import yamlio
from planning.plot_path import plot_path_problem
from replica.sim.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from replica.sim.roofline import Roofline

GB = 1e9


#: Parameters that may be 0: a workload with no shared prefix (the prefix-cache rows then equal
#: the rows without it), or prefill only (no output tokens). Every other one must be > 0.
ZERO_ALLOWED = frozenset({"shared_prefix_tokens", "output_tokens"})


@dataclass(frozen=True)
class LeverParams:
    """The scenario: one GPU, one model, one workload shape. Defaults are the seed scenario."""

    # The model.
    model_params: float = 8.03e9
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    # The GPU.
    hbm_gb: float = 80.0
    hbm_tbps: float = 3.35
    efficiency: float = 0.7
    bf16_tflops: float = 989.0
    #: None for a GPU without FP8 tensor cores (FP8 weights then compute in 16-bit).
    fp8_tflops: float | None = 1979.0
    mfu: float = 0.4
    price_per_hour: float = 3.00
    # The workload.
    prompt_tokens: int = 6000
    shared_prefix_tokens: int = 5000
    output_tokens: int = 300
    batch: int = 32
    large_batch: int = 128
    #: Weights + KV must fit in this fraction of HBM (vLLM's gpu_memory_utilization).
    fits_fraction: float = 0.9

    def __post_init__(self) -> None:
        # Every problem at once, one per line: a user fixing a params file should not need one
        # run per mistake.
        problems: list[str] = []
        bad: set[str] = set()
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "fp8_tflops" and value is None:
                continue
            zero_ok = f.name in ZERO_ALLOWED
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
                or (value == 0 and not zero_ok)
            ):
                bound = ">= 0" if zero_ok else "> 0"
                problems.append(f"{f.name}: must be a finite number {bound} (got {value!r})")
                bad.add(f.name)
            elif f.name in ("efficiency", "mfu", "fits_fraction") and value > 1:
                problems.append(f"{f.name}: must be in (0, 1] (got {value})")
        prompt, shared = self.prompt_tokens, self.shared_prefix_tokens
        if not {"prompt_tokens", "shared_prefix_tokens"} & bad and shared > prompt:
            problems.append(f"shared_prefix_tokens ({shared}) must be <= prompt_tokens ({prompt})")
        if not {"batch", "large_batch"} & bad and self.large_batch < self.batch:
            # The batch lever grows the batch: smaller, its row read as a lever that costs.
            problems.append(
                f"large_batch ({self.large_batch}) must be >= batch ({self.batch}): it is the "
                "batch the batch lever grows to"
            )
        if problems:
            raise ValueError("\n".join(problems))

    def hardware(self) -> HardwareProfile:
        """The GPU as a hardware profile for the roofline."""
        return HardwareProfile(
            name="levers-gpu",
            memory_gb=self.hbm_gb,
            hbm_bandwidth_tbps=self.hbm_tbps,
            bf16_tflops=self.bf16_tflops,
            fp8_tflops=self.fp8_tflops,
            price_per_hour=self.price_per_hour,
        )

    def model(self) -> ModelProfile:
        """The model as a model profile for the roofline."""
        return ModelProfile(
            name="levers-model",
            params=self.model_params,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
        )


@dataclass(frozen=True)
class Lever:
    """One lever setting: weight and KV dtypes, prefix cache on/off, which batch size."""

    name: str
    weight_dtype: str
    kv_dtype: str
    prefix_cache: bool
    large_batch: bool


def scenarios(params: LeverParams) -> list[Lever]:
    """The seven reference lever settings, in the reference order, each named for what it changes.

    Rows 1-5 pull one lever each on top of the row before; row 6 is the plain bf16 baseline at the
    large batch (to show it does not fit); row 7 is the memory-lean stack (INT4 weights, FP8 KV,
    prefix cache) back at the normal batch, so it compares with row 4.
    """
    big = params.large_batch
    shared = (
        f"{params.shared_prefix_tokens / 1000:g}k shared"
        if params.shared_prefix_tokens
        else "none shared"
    )
    return [
        Lever("bf16 weights + bf16 KV", "bf16", "bf16", False, False),
        Lever("FP8 weights (W8A8)", "fp8", "bf16", False, False),
        Lever("+ FP8 KV", "fp8", "fp8", False, False),
        Lever(f"+ prefix cache ({shared})", "fp8", "fp8", True, False),
        Lever(f"+ batch {big}", "fp8", "fp8", True, True),
        Lever(f"bf16 at batch {big}", "bf16", "bf16", False, True),
        Lever(f"INT4 (W4A16) + FP8 KV + cache, batch {params.batch}", "int4", "fp8", True, False),
    ]


@dataclass(frozen=True)
class LeverRow:
    """One line of the table."""

    scenario: str
    weight_dtype: str
    kv_dtype: str
    prefix_cache: bool
    batch: int
    weight_gb: float
    #: KV held in steady state: every sequence at the average context (shared prefix once when
    #: cached), the same context the decode reads use.
    kv_gb: float
    fits: bool
    ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    usd_per_m_output_tokens: float


def average_context(params: LeverParams) -> float:
    """Tokens of context a running sequence has on average: ``prompt + output / 2``.

    Sequences in a steady batch are spread evenly over their output, so on average each has
    generated half of it. Both the KV held and the KV read per step use this one figure.
    """
    return params.prompt_tokens + params.output_tokens / 2


def kv_tokens_held(params: LeverParams, batch: int, prefix_cache: bool) -> float:
    """Tokens of KV the cache holds for ``batch`` sequences at the average context.

    With the prefix cache the shared blocks are stored once, not once per sequence.
    """
    context = average_context(params)
    if not prefix_cache:
        return batch * context
    shared = params.shared_prefix_tokens
    return shared + batch * (context - shared)


def kv_tokens_read(params: LeverParams, batch: int) -> float:
    """Tokens of KV one decode step reads: every sequence reads its whole context.

    The prefix cache saves storage, not bandwidth: shared blocks are read by each sequence.
    """
    return batch * average_context(params)


def prefilled_tokens(params: LeverParams, prefix_cache: bool) -> int:
    """Prompt tokens one request computes before its first output token.

    With the prefix cache the shared prefix is already cached (its one-time prefill is spread over
    every request that reuses it, so it is left out), and only the unshared tokens are computed.
    """
    if prefix_cache:
        return params.prompt_tokens - params.shared_prefix_tokens
    return params.prompt_tokens


def lever_row(params: LeverParams, lever: Lever) -> LeverRow:
    """Compute one row from the roofline."""
    roofline = Roofline(
        hardware=params.hardware(),
        model=params.model(),
        weight_dtype=lever.weight_dtype,
        kv_dtype=lever.kv_dtype,
        efficiency=params.efficiency,
        mfu=params.mfu,
    )
    batch = params.large_batch if lever.large_batch else params.batch
    kv_bytes = kv_tokens_held(params, batch, lever.prefix_cache) * roofline.kv_bytes_per_token
    tpot_s = roofline.decode_s(kv_tokens_read(params, batch))
    tokens_per_s = batch / tpot_s
    return LeverRow(
        scenario=lever.name,
        weight_dtype=lever.weight_dtype,
        kv_dtype=lever.kv_dtype,
        prefix_cache=lever.prefix_cache,
        batch=batch,
        weight_gb=roofline.weight_bytes / GB,
        kv_gb=kv_bytes / GB,
        fits=kv_bytes <= roofline.kv_capacity_bytes(params.fits_fraction),
        ttft_ms=roofline.prefill_s(prefilled_tokens(params, lever.prefix_cache)) * 1000,
        tpot_ms=tpot_s * 1000,
        tokens_per_s=tokens_per_s,
        usd_per_m_output_tokens=params.price_per_hour / 3600 / tokens_per_s * 1e6,
    )


def lever_table(params: LeverParams | None = None) -> list[LeverRow]:
    """The seven rows of the lever table for ``params`` (the seed scenario by default).
    Raises ``ValueError`` where the inputs give figures a float cannot hold (each input finite,
    their product not: ``--model-params 1e308``, an MFU of 1e-320)."""
    params = params or LeverParams()
    try:
        rows = [lever_row(params, lever) for lever in scenarios(params)]
    except ArithmeticError:  # a decode time that overflowed, a rate of 0 divided by
        rows = []
    figures = [
        value for row in rows for value in asdict(row).values() if isinstance(value, float)
    ]
    if not rows or not all(math.isfinite(v) for v in figures) or any(
        row.tokens_per_s <= 0 for row in rows
    ):
        raise ValueError(
            "these parameters give figures past what the model can state (an infinite or zero "
            "time or rate): check the magnitudes of the model, GPU and workload numbers"
        )
    return rows


# --------------------------------------------------------------------------- output

#: (field, title, width, format); the scenario column is left-aligned, numbers right.
_COLUMNS = (
    ("scenario", "scenario", 38, ""),
    ("weight_gb", "weights GB", 10, ".1f"),
    ("kv_gb", "KV GB", 7, ".1f"),
    ("fits", "fits", 4, ""),
    ("ttft_ms", "TTFT ms", 8, ".1f"),
    ("tpot_ms", "TPOT ms", 8, ".2f"),
    ("tokens_per_s", "tok/s", 7, ".0f"),
    ("usd_per_m_output_tokens", "$/1M out", 8, ".3f"),
)


def format_table(rows: list[LeverRow], params: LeverParams) -> str:
    """The table as fixed-width text, with a header line that states the scenario."""
    fits_limit = params.fits_fraction * params.hbm_gb
    lines = [
        f"{params.model_params / 1e9:g}B params on one GPU ({params.hbm_gb:g} GB, "
        f"{params.hbm_tbps:g} TB/s × {params.efficiency:g}, MFU {params.mfu:g}, "
        f"${params.price_per_hour:.2f}/h); prompt {params.prompt_tokens} "
        f"({params.shared_prefix_tokens} shared), output {params.output_tokens}; "
        f"fits = weights + KV <= {fits_limit:g} GB",
    ]
    scenario_width = max(_COLUMNS[0][2], *(len(row.scenario) for row in rows))
    widths = [scenario_width] + [width for _k, _t, width, _f in _COLUMNS[1:]]
    titles = [title for _k, title, _w, _f in _COLUMNS]
    lines.append(
        " ".join(
            f"{t:<{w}}" if i == 0 else f"{t:>{w}}"
            for i, (t, w) in enumerate(zip(titles, widths, strict=True))
        )
    )
    for row in rows:
        values = asdict(row)
        values["fits"] = "yes" if row.fits else "NO"
        cells = [f"{row.scenario:<{scenario_width}}"]
        cells += [f"{values[key]:>{width}{fmt}}" for key, _t, width, fmt in _COLUMNS[1:]]
        lines.append(" ".join(cells))
    return "\n".join(lines)


def plot_table(rows: list[LeverRow], path: Path) -> None:
    """Bar charts of $/1M output tokens and TTFT/TPOT per scenario, written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    names = [row.scenario for row in rows]
    positions = range(len(rows))
    fig, (cost, latency) = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
    colours = ["tab:green" if row.fits else "tab:red" for row in rows]
    cost.barh(positions, [row.usd_per_m_output_tokens for row in rows], color=colours)
    cost.set_xlabel("$ per 1M output tokens (red: does not fit)")
    cost.set_yticks(list(positions), names)
    cost.invert_yaxis()
    width = 0.4
    latency.barh(
        [p - width / 2 for p in positions],
        [r.ttft_ms for r in rows],
        width,
        label="TTFT ms (prefill)",
    )
    latency.barh(
        [p + width / 2 for p in positions], [r.tpot_ms for r in rows], width, label="TPOT ms"
    )
    latency.set_yticks(list(positions), [""] * len(rows))
    latency.invert_yaxis()
    latency.set_xscale("log")
    latency.set_xlabel("milliseconds (log scale)")
    latency.legend()
    fig.suptitle("Roofline levers")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI

#: flag -> LeverParams field, for the flags that override one parameter.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model-params": ("model_params", float, "parameter count, e.g. 8.03e9"),
    "--layers": ("layers", int, "transformer layers"),
    "--kv-heads": ("kv_heads", int, "KV heads (GQA)"),
    "--head-dim": ("head_dim", int, "head dimension"),
    "--hbm-gb": ("hbm_gb", float, "GPU memory, GB"),
    "--hbm-tbps": ("hbm_tbps", float, "HBM bandwidth, TB/s"),
    "--efficiency": ("efficiency", float, "fraction of HBM bandwidth decode achieves"),
    "--bf16-tflops": ("bf16_tflops", float, "dense bf16 TFLOPS"),
    "--fp8-tflops": ("fp8_tflops", float, "dense FP8 TFLOPS"),
    "--mfu": ("mfu", float, "model FLOPs utilisation of prefill"),
    "--price-per-hour": ("price_per_hour", float, "USD per GPU-hour"),
    "--prompt-tokens": ("prompt_tokens", int, "prompt length"),
    "--shared-tokens": ("shared_prefix_tokens", int, "shared prefix length"),
    "--output-tokens": ("output_tokens", int, "output length"),
    "--batch": ("batch", int, "concurrent sequences"),
    "--large-batch": ("large_batch", int, "the larger batch of the batch lever"),
    "--fits-fraction": ("fits_fraction", float, "fraction of HBM usable (0..1]"),
}

EXAMPLES = """\
examples:
  fleetgate plan levers
  fleetgate plan levers --hardware h200 --batch 64 --json
  fleetgate plan levers --params scenario.yaml --plot levers.png
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``fleetgate plan levers``."""
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--params",
        type=Path,
        metavar="FILE.yaml",
        help="YAML mapping of parameter overrides (keys: the flag names with _ for -, but "
        "shared_prefix_tokens for --shared-tokens; plus 'hardware' and 'model' profile "
        "names); flags override it",
    )
    parser.add_argument("--hardware", help="start from a hardware profile (e.g. h100-sxm, h200)")
    parser.add_argument("--model", help="start from a model profile (e.g. llama3-70b)")
    for flag, (_field, kind, text) in _FLAGS.items():
        parser.add_argument(flag, type=kind, help=text, metavar="N" if kind is int else "X")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="also write a bar chart")


def params_from_args(args: argparse.Namespace) -> LeverParams:
    """Defaults, then named profiles, then the ``--params`` file, then flags."""
    from_file: dict[str, Any] = {}
    if args.params is not None:
        try:
            loaded = yamlio.load(args.params.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--params {args.params}: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--params {args.params}: expected a mapping of parameter: value")
        from_file = dict(loaded)
    params = LeverParams()
    hardware = args.hardware or from_file.pop("hardware", None)
    model = args.model or from_file.pop("model", None)
    from_file.pop("hardware", None)
    from_file.pop("model", None)
    if hardware:
        hw = load_hardware(hardware)
        params = replace(
            params,
            hbm_gb=hw.memory_gb,
            hbm_tbps=hw.hbm_bandwidth_tbps,
            bf16_tflops=hw.bf16_tflops,
            fp8_tflops=hw.fp8_tflops,
            price_per_hour=hw.price_per_hour,
        )
    if model:
        m = load_model(model)
        params = replace(
            params,
            model_params=m.params,
            layers=m.layers,
            kv_heads=m.kv_heads,
            head_dim=m.head_dim,
        )
    known = {f.name for f in fields(LeverParams)}
    problems = [
        f"--params {args.params}: {key}: unknown parameter{_did_you_mean(key, known)}"
        for key in sorted(set(from_file) - known)
    ]
    flags = {field: getattr(args, field_attr(flag)) for flag, (field, _k, _t) in _FLAGS.items()}
    overrides = {k: v for k, v in from_file.items() if k in known}
    overrides.update({k: v for k, v in flags.items() if v is not None})
    # A value given as a flag is named by its flag (``batch: must be...`` read as an inner name).
    given_as = {field: flag for flag, (field, _k, _t) in _FLAGS.items() if flags[field] is not None}
    try:  # the values are checked too, so that one run lists every problem
        params = replace(params, **overrides)
    except ValueError as exc:
        for line in str(exc).splitlines():
            for field, flag in given_as.items():
                line = re.sub(rf"\b{field}\b", flag, line)
            problems.append(line)
    if problems:
        raise ValueError("\n".join(problems))
    return params


def _did_you_mean(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def field_attr(flag: str) -> str:
    """argparse's attribute name for ``flag``."""
    return flag.lstrip("-").replace("-", "_")


def run(args: argparse.Namespace) -> int:
    """Print the lever table (or JSON); optionally write the plot. 2 on bad parameters."""
    try:
        params = params_from_args(args)
        rows = lever_table(params)
    except ValueError as exc:
        for line in str(exc).splitlines():
            print(f"fleetgate plan levers: error: {line}", file=sys.stderr)
        return 2
    problem = plot_path_problem(args.plot) if args.plot is not None else None
    if problem is not None:  # before printing: a failed run prints no table
        print(f"fleetgate plan levers: error: cannot write {args.plot}: {problem}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"params": asdict(params), "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_table(rows, params))
    if args.plot is not None:
        try:
            plot_table(rows, args.plot)
        except (OSError, ValueError) as exc:  # no such folder; a suffix matplotlib cannot write
            print(f"fleetgate plan levers: cannot write {args.plot}: {exc}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
