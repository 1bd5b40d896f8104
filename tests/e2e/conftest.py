"""Fixtures for end-to-end tests on real vLLM CPU engines (see docs/e2e.md).

Once per session: build the tiny model and its LoRA adapters (cached in the temp directory
across sessions), then start TWO real vLLM engines in parallel and wait for both to be healthy.
A missing vLLM venv FAILS the tests with the install command: it never skips, so CI cannot pass
without having exercised a real engine.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from replica.launcher import EngineSpec, VllmEngine, free_port
from replica.tiny_model import RECIPE_VERSION, TinyModel, ensure_tiny_model
from replica.vllm_env import INSTALL_COMMAND, VllmEnvMissing, require_vllm_env
from tests.e2e.e2e_support import E2EResults

#: The served model name of every e2e engine (what requests put in ``model``).
SERVED_MODEL = "tiny"
#: Engines get this long to become healthy (observed: 40-90 s on 2 cores).
ENGINE_START_TIMEOUT_S = 300.0
ENGINE_COUNT = 2
#: KV-cache blocks per engine (``--num-gpu-blocks-override``; 1 GiB would give 32,768). A cache
#: that holds only part of a shared-prefix workload is what makes routing matter: with 32,768
#: blocks every engine keeps every prefix and round-robin loses only each prefix's first visit.
#: 112 blocks = 3,584 tokens: at least one ``--max-model-len`` sequence (64 blocks), and room for
#: 4.6 of the routing test's 24-block prefixes (see tests/e2e/test_e2e_gateway_vllm.py).
KV_BLOCKS_PER_ENGINE = 112


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's interpreter; fails (never skips) with the install command if absent."""
    try:
        return require_vllm_env(check_import=True)
    except VllmEnvMissing as exc:
        pytest.fail(
            f"e2e tests need a real vLLM CPU engine: {exc}\n"
            f"Install it once with: {INSTALL_COMMAND}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> TinyModel:
    """The tiny Llama + 3 LoRA adapters, built once and cached under the temp directory."""
    cache = Path(tempfile.gettempdir()) / f"fleetgate-tiny-model-r{RECIPE_VERSION}"
    return ensure_tiny_model(cache, adapters=3, python=vllm_python)


@pytest.fixture(scope="session")
def vllm_engines(
    vllm_python: Path, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """Two real vLLM engines, started in parallel once per session, stopped at the end."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    engines = [
        VllmEngine(
            EngineSpec(
                model=tiny_model.model_dir,
                served_model_name=SERVED_MODEL,
                replay_port=free_port(),
                # Priority scheduling: with every request at vLLM's default priority 0 it is
                # first-come-first-served; tests/e2e/test_e2e_engine_priority_vllm.py sends others.
                extra_args=(
                    "--num-gpu-blocks-override",
                    str(KV_BLOCKS_PER_ENGINE),
                    "--scheduling-policy",
                    "priority",
                ),
                # Dev mode exposes POST /reset_prefix_cache, which makes the engine publish
                # AllBlocksCleared: the only way to see that event from a real engine. The
                # Responses store keeps /v1/responses answers for previous_response_id (vLLM
                # ignores store=true without it; tests/e2e/test_e2e_apis_vllm.py).
                extra_env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_RESPONSES_API_STORE": "1"},
            ),
            log_path=logs / f"engine-{i}.log",
            python=vllm_python,
        )
        for i in range(ENGINE_COUNT)
    ]
    try:
        for engine in engines:
            engine.start()
        with ThreadPoolExecutor(len(engines)) as pool:
            startup_s = list(pool.map(lambda e: e.wait_healthy(ENGINE_START_TIMEOUT_S), engines))
        print(f"\nvLLM engines healthy after {', '.join(f'{s:.0f}s' for s in startup_s)}")
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@pytest.fixture(scope="session")
def vllm_engine(vllm_engines: list[VllmEngine]) -> VllmEngine:
    """The first of the session's engines."""
    return vllm_engines[0]


@pytest.fixture(scope="session")
def e2e_results() -> Iterator[E2EResults]:
    """Numbers the gateway e2e tests measure; printed at the end of the session, and written to
    docs/benchmarks/e2e-vllm.md when every gateway e2e test recorded its section."""
    results = E2EResults()
    yield results
    if results.sections:
        print(f"\n{results.render()}")
        # Only a run of every gateway e2e test rewrites the committed numbers.
        if len(results.sections) == results.expected_sections:
            print(f"written to {results.write()}")
