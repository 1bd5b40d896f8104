"""`fleetgate advise` on a real vLLM CPU engine: its real flags, its real metrics, and a
`--max-model-len` recommendation derived from the traffic this test sends it.

The session's engine (tests/e2e/conftest.py) runs with --max-model-len 2048 and --block-size 32.
Other e2e tests share it, so the lengths are read over a window: one scrape, this test's
requests (sent from the reader's `sleep` hook, so nothing else happens in between on this
side), a second scrape; only what the engine counted between the two is used.
"""

from __future__ import annotations

import httpx
import pytest

from planning.advise import advise
from planning.advise.live import Target, read_live
from planning.advise.sizing import round_up
from replica.launcher import VllmEngine
from tests.e2e.conftest import SERVED_MODEL
from tests.e2e.e2e_support import fresh_text

pytestmark = [pytest.mark.e2e]

ENGINE_MAX_MODEL_LEN = 2048  # EngineSpec's default
BLOCK = 32
OUTPUT_TOKENS = 16


def test_advise_reads_a_real_engine_and_cuts_max_model_len(vllm_engine: VllmEngine) -> None:
    sent: list[int] = []

    def send_traffic(_interval_s: float) -> None:
        # Prompts of known, modest lengths (well under vLLM's 1,000-token bucket bound).
        with httpx.Client(base_url=vllm_engine.url, timeout=120) as http:
            for words in range(24, 121, 8):
                body = {
                    "model": SERVED_MODEL,
                    "prompt": fresh_text(words),
                    "max_tokens": OUTPUT_TOKENS,
                    "ignore_eos": True,
                }
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                usage = response.json()["usage"]
                sent.append(usage["prompt_tokens"] + usage["completion_tokens"])

    with httpx.Client(timeout=30) as client:
        pools = read_live(
            [Target(vllm_engine.url, "e2e")],
            client,
            samples=2,
            interval_s=0.0,
            sleep=send_traffic,
            window_lengths=True,
        )
    pool = pools["e2e"]
    flags = pool.flags
    # The engine's own account of itself.
    assert flags.max_model_len == ENGINE_MAX_MODEL_LEN
    assert flags.source("max_model_len") == "engine-reported"
    assert flags.block_size == BLOCK and flags.num_gpu_blocks
    assert flags.enable_prefix_caching is True
    assert flags.enable_lora is True and flags.max_loras == vllm_engine.spec.max_loras
    m = pool.measured
    assert m.requests == len(sent)
    assert m.preemptions_per_min is not None and m.kv_usage is not None
    # Prefill time is vLLM's own timer, not TTFT minus queue.
    assert "prefill" in m.timers and "ttft" in m.timers

    row = next(r for r in advise(pool) if r.flag == "--max-model-len")
    print(f"\nadvise, real engine: {row.flag} {row.current} -> {row.advised}: {row.evidence}")
    assert row.kind == "change", row
    assert row.advised % BLOCK == 0
    assert max(sent) <= m.context_max <= row.advised < ENGINE_MAX_MODEL_LEN
    assert row.advised == round_up(max(m.context_p99 * 1.25, m.context_max), BLOCK)
