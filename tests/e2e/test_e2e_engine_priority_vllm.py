"""Engine priority on the session's two REAL vLLM CPU engines (``--scheduling-policy
priority``): the gateway sends each request's class as vLLM's ``priority`` and vLLM serves
them; the integration tier (tests/integration/test_engine_priority.py) checks the values sent.

Prompts are a sentence long: vLLM 0.32's CPU build, with LoRA enabled as here, loses its worker
(SIGILL) on a two-token prompt such as "hello", whatever the scheduling policy.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from replica.launcher import VllmEngine
from replica.tiny_model import TinyModel
from tests.e2e.e2e_support import SERVED_MODEL, gateway_stack

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

PROMPT = "Rule 1: answer briefly about the fleet. Rule 2: say which replica served you."


async def test_vllm_schedules_by_priority_and_serves_what_the_gateway_sends(
    redis_url: str, vllm_engines: list[VllmEngine], tiny_model: TinyModel, tmp_path: Path
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        # The engine itself takes a non-zero priority: under first-come-first-served vLLM
        # would answer 400 ("Priority scheduling is not enabled").
        body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 2, "priority": 1}
        resp = await http.post(f"{vllm_engines[0].url}/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
    async with gateway_stack(redis_url, vllm_engines, tiny_model, tmp_path) as stack:
        # Critical (-1), standard (0) and sheddable (1) through the gateway, on the official
        # client; a client's own priority is replaced by its tenant's class.
        for tenant in ("urgent", "alpha", "batch"):
            answer = await stack.client(tenant).completions.create(
                model=SERVED_MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 7}
            )
            assert answer.usage is not None and answer.usage.completion_tokens == 2
            chat = await stack.client(tenant).chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=2
            )
            assert chat.usage is not None and chat.usage.completion_tokens == 2
