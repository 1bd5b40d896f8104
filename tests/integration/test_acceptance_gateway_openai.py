"""Acceptance: the official ``openai`` client against the real ``fleetgate`` CLI in subprocesses.

* ``fleetgate up --sim 2 --adapters 2``: chat and completions, streaming and not, model listing,
  a demo LoRA adapter, and the request errors any key can hit (400, 404, 413);
* ``fleetgate serve --config policy.yaml`` in front of ``fleetgate sim`` processes: the errors
  that need tenants and pools (401, 404 for another tenant's adapter, 413, 429, 503, 504).

Every error must reach the client as the matching ``openai`` exception, with the status and the
gateway's stable ``code`` from the OpenAI error envelope. One more check: a stream that keeps
producing tokens must not be cut by the upstream timeout.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest

from tests.support.redis_server import free_port

MODEL = "sim-model"
ADMIN_KEY = "acceptance-admin"


@dataclass
class CliProcess:
    """``fleetgate ARGS`` in a subprocess; its output is collected line by line."""

    args: list[str]
    process: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)
    _changed: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> CliProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fleetgate.cli", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(
        self, pattern: str, count: int = 1, timeout_s: float = 60.0
    ) -> list[re.Match[str]]:
        """The first ``count`` matches of ``pattern`` in the output, waiting (bounded) for them."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = [m for line in self.lines if (m := re.search(pattern, line))]
                if len(found) >= count:
                    return found[:count]
                assert self.process is not None
                exited = self.process.poll() is not None
                remaining = deadline - time.monotonic()
                if exited or remaining <= 0:
                    raise AssertionError(
                        f"fleetgate {' '.join(self.args)}: no {pattern!r} "
                        f"({'exited' if exited else 'timed out'}):\n{''.join(self.lines)}"
                    )
                self._changed.wait(min(remaining, 0.5))

    def stop(self, grace_s: float = 30.0) -> int | None:
        """Ctrl-C; the exit status, or None if it had to be killed after ``grace_s``."""
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            return None


@pytest.fixture(scope="module")
def up_url() -> Iterator[str]:
    """``fleetgate up --sim 2 --adapters 2`` on a free port."""
    port = free_port()
    up = CliProcess(
        [
            "up",
            "--sim",
            "2",
            "--port",
            str(port),
            "--sim-speed",
            "1000",
            "--adapters",
            "2",
            "--admin-key",
            ADMIN_KEY,
        ]
    ).start()
    try:
        (match,) = up.wait_for(r"fleetgate is up: (http://127\.0\.0\.1:\d+)")
        assert match.group(1) == f"http://127.0.0.1:{port}"
        yield match.group(1)
    finally:
        assert up.stop() == 0


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


POLICY = """
version: 1
gateway:
  max_body_bytes: 65536
  upstream_timeout_s: 2
  connect_timeout_s: 1
  health_check_interval_s: 0.5
replica_pools:
  - name: fast
    replicas: [{fast}]
  - name: slow
    replicas: [{slow}]
  - name: steady
    replicas: [{steady}]
  - name: dead
    replicas: [{dead}]
models:
  - name: sim-model
    pools: [fast]
  - name: slow-model
    pools: [slow]
  - name: steady-model
    pools: [steady]
  - name: dead-model
    pools: [dead]
tenants:
  - name: acme
    api_key_sha256: [{acme}]
  - name: globex
    api_key_sha256: [{globex}]
  - name: limited
    api_key_sha256: [{limited}]
    rate_limit: {{requests_per_s: 0.001, burst: 1}}
adapters:
  - name: acme-lora
    base_model: sim-model
    source: /adapters/acme/acme-lora
    rank: 8
    owners: [acme]
routes:
  - name: main
    profile: expected-ttft
"""


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``fleetgate serve --config`` over four pools: a fast sim; a very slow sim (modelled time
    at 1/100 of real time: a 20-token answer takes many times the 2 s upstream timeout); a
    steady sim at 1/10 of real time (first token well inside 2 s, a 60-token stream well past
    it); and a replica URL where nothing listens."""
    sim_line = r"replica 0: (http://127\.0\.0\.1:\d+)"
    fast = CliProcess(["sim", "--port", "0", "--speed", "1000"]).start()
    slow = CliProcess(["sim", "--port", "0", "--speed", "0.01", "--model", "slow-model"]).start()
    steady = CliProcess(["sim", "--port", "0", "--speed", "0.1", "--model", "steady-model"])
    sims = [fast, slow, steady.start()]
    gateway = None
    try:
        fast_url, slow_url, steady_url = (sim.wait_for(sim_line)[0].group(1) for sim in sims)
        path = tmp_path_factory.mktemp("policy") / "policy.yaml"
        path.write_text(
            POLICY.format(
                fast=fast_url,
                slow=slow_url,
                steady=steady_url,
                dead=f"http://127.0.0.1:{free_port()}",
                acme=sha("acme-key"),
                globex=sha("globex-key"),
                limited=sha("limited-key"),
            )
        )
        gateway = CliProcess(
            [
                "serve",
                "--config",
                str(path),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--admin-key",
                ADMIN_KEY,
            ]
        ).start()
        yield gateway.wait_for(r"listening on (http://127\.0\.0\.1:\d+)")[0].group(1)
    finally:
        if gateway is not None:
            assert gateway.stop() == 0
        for sim in sims:
            # A sim keeps generating for a client that left a non-streamed request (unlike
            # vLLM), which holds up its graceful stop: it is test scaffolding, kill it.
            sim.stop(grace_s=3)


def client(url: str, key: str = "any-key") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


# --------------------------------------------------------------------------- fleetgate up


async def test_up_chat_and_completions_streaming_and_not(up_url: str) -> None:
    async with client(up_url) as api:
        chat = await api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 5

        text = await api.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
        assert text.choices[0].text
        assert text.usage is not None and text.usage.completion_tokens == 5

        stream = await api.chat.completions.create(
            model=MODEL, messages=HELLO, max_tokens=5, stream=True
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"

        stream = await api.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [c async for c in stream]
        assert "".join(c.choices[0].text for c in pieces if c.choices)
        assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 5


async def test_up_lists_the_base_model_and_demo_adapters(up_url: str) -> None:
    async with client(up_url) as api:
        models = await api.models.list()
        one = await api.models.retrieve("demo-lora-1")
        with pytest.raises(openai.NotFoundError) as missing:
            await api.models.retrieve("no-such-model")
    assert {m.id: getattr(m, "parent", None) for m in models.data} == {
        MODEL: None,
        "demo-lora-0": MODEL,
        "demo-lora-1": MODEL,
    }
    assert (one.id, getattr(one, "parent", None)) == ("demo-lora-1", MODEL)
    assert missing.value.body["code"] == "model_not_found"


async def test_up_serves_a_demo_adapter(up_url: str) -> None:
    async with client(up_url) as api:
        reply = await api.chat.completions.create(model="demo-lora-1", messages=HELLO, max_tokens=3)
        assert reply.model == "demo-lora-1" and reply.choices[0].message.content
        stream = await api.completions.create(
            model="demo-lora-1", prompt="Once upon a time", max_tokens=3, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream if c.choices])


def _error_code(err: openai.APIStatusError) -> str | None:
    body = err.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "code"}, body
    return err.code


async def test_up_request_errors_are_openai_exceptions(up_url: str) -> None:
    async with client(up_url) as api:
        with pytest.raises(openai.BadRequestError) as bad_json:
            await api.post(
                "/chat/completions",
                cast_to=object,
                content=b'{"model": "sim-model", "messages": [',
                options={"headers": {"Content-Type": "application/json"}},
            )
        with pytest.raises(openai.BadRequestError) as bad_field:
            await api.chat.completions.create(model=MODEL, messages=[])
        with pytest.raises(openai.NotFoundError) as unknown:
            await api.chat.completions.create(model="no-such-model", messages=HELLO)
        # One byte over ``fleetgate up``'s 8 MiB body limit.
        with pytest.raises(openai.APIStatusError) as too_large:
            await api.completions.create(model=MODEL, prompt="x" * (8 * 1024 * 1024))
    assert (bad_json.value.status_code, _error_code(bad_json.value)) == (400, "invalid_json")
    assert (bad_field.value.status_code, _error_code(bad_field.value)) == (400, "invalid_request")
    assert (unknown.value.status_code, _error_code(unknown.value)) == (404, "model_not_found")
    assert (too_large.value.status_code, _error_code(too_large.value)) == (
        413,
        "request_too_large",
    )


# --------------------------------------------------------------------------- fleetgate serve


async def test_serve_bad_api_key_is_401(serve_url: str) -> None:
    async with client(serve_url, "wrong-key") as api:
        with pytest.raises(openai.AuthenticationError) as err:
            await api.chat.completions.create(model=MODEL, messages=HELLO)
    assert (err.value.status_code, _error_code(err.value)) == (401, "invalid_api_key")


async def test_serve_other_tenants_adapter_is_the_same_404_as_an_unknown_model(
    serve_url: str,
) -> None:
    async with client(serve_url, "acme-key") as acme:
        reply = await acme.chat.completions.create(model="acme-lora", messages=HELLO, max_tokens=2)
        assert reply.model == "acme-lora"
    errors: dict[str, openai.NotFoundError] = {}
    async with client(serve_url, "globex-key") as globex:
        for name in ("acme-lora", "globex-nope"):
            with pytest.raises(openai.NotFoundError) as err:
                await globex.chat.completions.create(model=name, messages=HELLO)
            errors[name] = err.value
    forbidden, unknown = errors["acme-lora"], errors["globex-nope"]
    assert forbidden.status_code == unknown.status_code == 404
    assert _error_code(forbidden) == _error_code(unknown) == "model_not_found"
    assert forbidden.body == {
        k: v.replace("globex-nope", "acme-lora") if isinstance(v, str) else v
        for k, v in unknown.body.items()  # type: ignore[union-attr]
    }


async def test_serve_body_over_the_policy_limit_is_413(serve_url: str) -> None:
    async with client(serve_url, "acme-key") as api:
        with pytest.raises(openai.APIStatusError) as err:
            await api.completions.create(model=MODEL, prompt="word " * 20_000)
    assert (err.value.status_code, _error_code(err.value)) == (413, "request_too_large")


async def test_serve_rate_limited_tenant_gets_429(serve_url: str) -> None:
    async with client(serve_url, "limited-key") as api:
        await api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as err:
            await api.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert (err.value.status_code, _error_code(err.value)) == (429, "rate_limit_exceeded")
    assert int(err.value.response.headers["Retry-After"]) >= 1


async def test_serve_model_without_a_healthy_replica_is_503(serve_url: str) -> None:
    async with client(serve_url, "acme-key") as api:
        with pytest.raises(openai.InternalServerError) as err:
            await api.chat.completions.create(model="dead-model", messages=HELLO)
    assert (err.value.status_code, _error_code(err.value)) == (503, "no_healthy_replica")


async def test_serve_upstream_timeout_is_504(serve_url: str) -> None:
    async with client(serve_url, "acme-key") as api:
        with pytest.raises(openai.InternalServerError) as err:
            await api.chat.completions.create(model="slow-model", messages=HELLO, max_tokens=20)
    assert (err.value.status_code, _error_code(err.value)) == (504, "upstream_timeout")


async def test_serve_stream_longer_than_the_upstream_timeout_is_not_cut(serve_url: str) -> None:
    async with client(serve_url, "acme-key") as api:
        stream = await api.chat.completions.create(
            model="steady-model",
            messages=HELLO,
            max_tokens=60,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 60
