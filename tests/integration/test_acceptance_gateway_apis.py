"""Acceptance: the official ``openai`` and ``anthropic`` clients against the real
``fleetgate up --sim 2`` in a subprocess: Responses (stream and not, a follow-up with
``previous_response_id``), embeddings, and Anthropic Messages (stream and not)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.integration.test_acceptance_gateway_openai import CliProcess
from tests.support.redis_server import free_port

MODEL = "sim-model"
ADMIN_KEY = "acceptance-apis-admin"


@pytest.fixture(scope="module")
def up_url() -> Iterator[str]:
    port = free_port()
    up = CliProcess(
        ["up", "--sim", "2", "--port", str(port), "--sim-speed", "1000",
         "--admin-key", ADMIN_KEY]
    ).start()
    try:
        (match,) = up.wait_for(r"fleetgate is up: (http://127\.0\.0\.1:\d+)")
        yield match.group(1)
    finally:
        assert up.stop() == 0


def test_openai_client_responses_and_embeddings(up_url: str) -> None:
    client = openai.OpenAI(base_url=f"{up_url}/v1", api_key="any", max_retries=0)
    first = client.responses.create(
        model=MODEL, instructions="Be brief.", input="hello", max_output_tokens=3,
        extra_headers={"X-Request-Id": "acc-first"},
    )
    assert first.output_text.strip()
    with client.responses.stream(
        model=MODEL, input="and now?", previous_response_id=first.id, max_output_tokens=3,
        extra_headers={"X-Request-Id": "acc-follow"},
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.previous_response_id == first.id
    assert final.output_text == "".join(deltas)
    vectors = client.embeddings.create(model=MODEL, input="alpha beta")
    assert len(vectors.data[0].embedding) == 64
    decisions = httpx.get(
        f"{up_url}/admin/decisions?n=50", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()["decisions"]
    by_id = {d["request_id"]: d for d in decisions}
    assert by_id["acc-follow"]["served_by"] == by_id["acc-first"]["served_by"]


def test_anthropic_client_messages(up_url: str) -> None:
    client = anthropic.Anthropic(base_url=up_url, api_key="any", max_retries=0)
    message = client.messages.create(
        model=MODEL, system="Be brief.", max_tokens=3,
        messages=[{"role": "user", "content": "hello"}],
    )
    assert message.content[0].type == "text" and message.content[0].text.strip()
    with client.messages.stream(
        model=MODEL, system="Be brief.", max_tokens=3,
        messages=[{"role": "user", "content": "hello"}],
    ) as stream:
        text = "".join(stream.text_stream)
    assert text.strip()
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=3, messages=[{"role": "user", "content": "x"}]
        )
