"""``fleetgate bench replay`` against simulated replicas on real sockets, plus its pure parts."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from bench.replay import PromptText, ReplayConfig
from bench.replay.runner import replay_async
from bench.replay.server_metrics import CacheCounters, parse_cache_counters
from bench.replay.summary import render_table, summarize
from replica.sim.fleet import start_sim_fleet
from routing.tokenize.word_hash import load_tokenizer
from tests.integration.test_gateway_support import engine_app, serve
from tests.support.polling import wait_until
from traces.format import TraceRecord, write_trace

BLOCK = 32  # words (= tokens on the simulated replica) per trace block


def _trace() -> list[TraceRecord]:
    return [
        TraceRecord(0, 2 * BLOCK, 4, (1, 2)),
        TraceRecord(100, 2 * BLOCK, 4, (1, 2)),  # the same prompt again
        TraceRecord(200, 3 * BLOCK, 4, (1, 2, 3)),  # extends it by one block
        TraceRecord(300, 2 * BLOCK, 4, (7, 8)),  # unrelated
    ]


def test_equal_ids_give_equal_text_and_one_token_per_word() -> None:
    text = PromptText(BLOCK)
    a = text.prompt((1, 2), 2 * BLOCK)
    b = text.prompt((1, 2, 3), 3 * BLOCK)
    c = text.prompt((7, 2), 2 * BLOCK)
    assert b.startswith(a + " ")
    assert c.split()[BLOCK:] == a.split()[BLOCK:]  # same id, same block text
    assert c.split()[:BLOCK] != a.split()[:BLOCK]
    tokenizer = load_tokenizer(None)
    assert len(tokenizer.encode(b, add_special_tokens=False)) == 3 * BLOCK
    # A partial last block is cut, as in the trace.
    assert len(text.prompt((1, 2), BLOCK + 5).split()) == BLOCK + 5


def test_cache_counters_are_summed_over_label_sets() -> None:
    exposition = "\n".join(
        [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 120.0',
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 30.0',
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0 1700000000000',
            "vllm:prefix_cache_queries_created 1.7e9",
        ]
    )
    assert parse_cache_counters(exposition) == CacheCounters(queries=400.0, hits=150.0)


async def test_replay_against_a_simulated_replica_counts_prefix_hits() -> None:
    async with start_sim_fleet(1, speed=1000, kv_events=None, kv_replay=None) as fleet:
        config = ReplayConfig(
            url=fleet.urls[0],
            model=fleet.model,
            trace_block_size=BLOCK,
            concurrency=1,  # one at a time: each request's blocks are cached before the next
            metrics_urls=(fleet.urls[0] + "/metrics",),
        )
        result = await replay_async(config, _trace())
    summary = summarize(result)
    assert summary["ok"] == 4, summary["errors"]
    assert all(r.completion_tokens == 4 for r in result.results)
    # The replica's tokenizer adds BOS: prompts are 65, 65, 97 and 65 tokens. Request 2 reuses
    # the 4 full 16-token blocks of request 1 (64 of 65 tokens: the last is always recomputed);
    # request 3 the same 4 blocks (request 1's fifth block was never full); request 4 nothing:
    # its first block already differs after BOS.
    queries = 65 + 65 + 97 + 65
    hits = 64 + 64
    assert summary["server_prefix_hit_rate"] == pytest.approx(hits / queries)
    assert summary["client_cached_rate"] == pytest.approx(hits / queries)
    assert summary["ttft_p50_ms"] is not None and summary["itl_p50_ms"] is not None
    assert summary["tpot_p50_ms"] is not None and summary["output_tokens"] == 16
    # The start-lag warning only when the replay fell behind the trace's pace.
    assert summary["warnings"] == []
    for r in result.results:
        r.start_lag_s = 0.25
    late = summarize(result)
    assert len(late["warnings"]) == 1 and "start lag p95 250 ms" in late["warnings"][0]
    assert "warning: client start lag p95 250 ms" in render_table(late)


async def test_a_wrong_model_or_a_dead_url_is_refused_before_the_trace_is_sent() -> None:
    # Both failed every request, the whole trace's length later (the CLI review: 29.7 s for a
    # 29.5 s trace), with the error cut mid-word.
    from bench.replay import EndpointProblem

    async with start_sim_fleet(1, speed=1000, kv_events=None, kv_replay=None) as fleet:
        wrong = ReplayConfig(url=fleet.urls[0], model="nope", trace_block_size=BLOCK)
        with pytest.raises(EndpointProblem, match="does not serve the model 'nope'; it serves: "):
            await replay_async(wrong, _trace())
        # The replay never started: the engine finished no request.
        async with (
            aiohttp.ClientSession() as http,
            http.get(fleet.urls[0] + "/metrics") as resp,
        ):
            assert "vllm:request_success_total{" not in await resp.text()
    dead = ReplayConfig(url="http://127.0.0.1:1/v1", model="m", trace_block_size=BLOCK)
    with pytest.raises(EndpointProblem, match=re.escape("cannot reach http://127.0.0.1:1/v1/models")):
        await replay_async(dead, _trace())


@pytest.mark.parametrize("limit", [None, 3])
def test_cli_replays_and_prints_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: int | None
) -> None:
    import asyncio
    import threading

    from fleetgate.cli import main

    trace = tmp_path / "trace.jsonl"
    write_trace(_trace(), trace)
    if limit is not None:  # a bad line past --limit: only the lines replayed are read
        with trace.open("a") as f:
            f.write("{not json\n")
    ready = threading.Event()
    stop = threading.Event()
    urls: list[str] = []

    def serve() -> None:
        async def run() -> None:
            async with start_sim_fleet(1, speed=1000, kv_events=None, kv_replay=None) as fleet:
                urls.append(fleet.urls[0])
                ready.set()
                while not stop.is_set():
                    await asyncio.sleep(0.01)

        asyncio.run(run())

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        assert ready.wait(30)
        argv = ["bench", "replay", "--trace", str(trace), "--url", urls[0] + "/v1"]
        argv += ["--model", "sim-model", "--trace-block-size", str(BLOCK), "--time-scale", "0"]
        argv += ["--metrics-url", urls[0] + "/metrics", "--json"]
        argv += [] if limit is None else ["--limit", str(limit)]
        assert main(argv) == 0
    finally:
        stop.set()
        server.join(30)
    summary = json.loads(capsys.readouterr().out)
    replayed = limit or 4
    assert summary["requests"] == replayed and summary["ok"] == replayed
    assert set(summary["server_prefix_cache"]) == {urls[0] + "/metrics"}


def _scripted_engine(
    mode: str, arrived: list[int] | None = None, answer_first: int | None = None
) -> web.Application:
    """An engine whose completions stream as ``mode`` says: ``cut`` (two tokens, then the
    connection ends without ``[DONE]``), ``error`` (two tokens, then vLLM's in-band error
    event), ``crlf`` (a whole stream, events separated by CRLF as sse-starlette sends them),
    ``cr`` (CR only), ``null`` (a ``data: null`` event amid a whole stream), ``every-second-cut``
    (every second request cut, with ``arrived``); ``ok`` streams whole. ``arrived`` counts the
    requests that came; past the first ``answer_first`` of them, none is answered (it waits
    until the test ends)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        if arrived is not None:
            arrived.append(1)
            if answer_first is not None and len(arrived) > answer_first:
                await asyncio.Event().wait()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        end = {"crlf": b"\r\n\r\n", "cr": b"\r\r"}.get(mode, b"\n\n")

        async def send(payload: object) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            await response.write(b"data: " + data + end)

        for word in ("a", "b"):
            await send({"choices": [{"index": 0, "text": word}]})
        if mode == "cut" or (mode == "every-second-cut" and arrived and len(arrived) % 2 == 0):
            return response
        if mode == "error":
            await send({"error": {"message": "replica died mid-stream", "code": 502}})
            return response
        if mode == "null":
            await send(b"null")
        usage = {"prompt_tokens": 64, "completion_tokens": 2}
        await send({"choices": [], "usage": usage})
        await send(b"[DONE]")
        return response

    return engine_app("m", {"/v1/completions": completions})


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("cut", "stream ended before data: [DONE] (cut short)"),
        ("error", "stream failed: replica died mid-stream"),
        ("null", "an event that is not a JSON object: b'null'"),
        ("crlf", None),
        ("cr", None),
    ],
)
async def test_a_stream_counts_as_served_only_when_it_ends_well(
    mode: str, error: str | None
) -> None:
    # A stream cut by a dying replica after its first tokens counted as served (the replay
    # review: "ok 500" while the gateway counted 24 502s); a CRLF stream failed every request,
    # and one "data: null" crashed the whole replay.
    async with serve(_scripted_engine(mode)) as url:
        config = ReplayConfig(url=url, model="m", trace_block_size=BLOCK, time_scale=0)
        summary = summarize(await replay_async(config, _trace()))
    if error is None:
        assert summary["ok"] == 4 and summary["errors"] == {}
        assert summary["tpot_p50_ms"] is not None
    else:
        assert summary["ok"] == 0 and summary["errors"] == {error: 4}


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
async def test_a_replay_stopped_by_a_signal_reports_what_finished(
    tmp_path: Path, signum: int, code: int
) -> None:
    # Ctrl-C or SIGTERM (a CI timeout) threw every result away: exit 130/143 and nothing else.
    trace = tmp_path / "trace.jsonl"
    write_trace([TraceRecord(0, 2 * BLOCK, 2, (i, i + 1)) for i in range(0, 8, 2)], trace)
    arrived: list[int] = []
    # One at a time: the fourth is sent once the third is recorded, and is never answered.
    async with serve(_scripted_engine("ok", arrived, answer_first=3)) as url:
        argv = ["bench", "replay", "--trace", str(trace), "--url", url, "--model", "m"]
        argv += ["--trace-block-size", str(BLOCK), "--json", "--concurrency", "1"]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleetgate.cli", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            await wait_until(lambda: len(arrived) == 4, "the fourth request sent", timeout_s=60)
            process.send_signal(signum)
            out, err = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
    assert process.returncode == code, err.decode()
    summary = json.loads(out)
    assert summary["interrupted"] == signal.Signals(signum).name
    assert summary["planned"] == 4 and summary["requests"] == 3 and summary["ok"] == 3
    assert summary["run"]["trace"] == str(trace) and summary["run"]["model"] == "m"


def test_warnings_for_gaps_read_together_and_a_metrics_url_without_vllm_counters() -> None:
    from bench.replay.client import RequestResult
    from bench.replay.runner import ReplayResult

    together = RequestResult(0, 0.0, ok=True, ttft_s=0.05, e2e_s=1.0, tpot_s=0.01)
    together.itl_s = [0.0] * 30 + [0.02] * 30
    steady = RequestResult(1, 0.0, ok=True, ttft_s=0.05, e2e_s=1.0, tpot_s=0.01)
    steady.itl_s = [0.01] * 60
    gateway = "http://gw/metrics"
    summary = summarize(ReplayResult([together], 1.0, {gateway: CacheCounters(0.0, 0.0)}))
    assert [w.split(" ")[0] for w in summary["warnings"]] == ["many", gateway]
    assert summarize(ReplayResult([steady], 1.0, {})).get("warnings") == []


async def test_a_signal_before_any_request_is_sent_is_a_clean_stop(tmp_path: Path) -> None:
    # Ctrl-C during the models check (a slow endpoint) printed a traceback and exited 1.
    trace = tmp_path / "trace.jsonl"
    write_trace(_trace(), trace)
    asked = asyncio.Event()

    async def models(request: web.Request) -> web.Response:
        asked.set()
        await asyncio.Event().wait()  # never answers
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with serve(app) as url:
        argv = ["bench", "replay", "--trace", str(trace), "--url", url, "--model", "m", "--json"]
        argv += ["--trace-block-size", str(BLOCK)]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleetgate.cli", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(asked.wait(), 60)
            process.send_signal(signal.SIGINT)
            out, err = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
    assert process.returncode == 130, err.decode()
    summary = json.loads(out)
    assert (summary["interrupted"], summary["requests"], summary["planned"]) == ("SIGINT", 0, 4)


@pytest.mark.parametrize(("flag", "code"), [([], 0), (["--max-error-rate", "0.5"], 0),
                                            (["--max-error-rate", "0.25"], 1)])
async def test_max_error_rate_decides_the_exit_status(
    tmp_path: Path, flag: list[str], code: int
) -> None:
    # Half the requests failed and the replay exited 0: CI could not tell (the replay review).
    trace = tmp_path / "trace.jsonl"
    write_trace(_trace(), trace)
    arrived: list[int] = []
    async with serve(_scripted_engine("every-second-cut", arrived)) as url:
        argv = ["bench", "replay", "--trace", str(trace), "--url", url, "--model", "m", "--json"]
        argv += ["--trace-block-size", str(BLOCK), "--concurrency", "1", *flag]
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleetgate.cli", *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == code, err.decode()
    assert json.loads(out)["ok"] == 2
    if code:
        assert "2 of 4 requests failed, more than --max-error-rate 0.25" in err.decode()


def test_a_cr_only_event_is_complete_when_its_blank_line_arrives() -> None:
    # Held back for a possible CRLF, every CR-only event was read one chunk late (TTFT p50 104
    # against 53 ms: the re-check review).
    from bench.replay.client import _events

    assert _events(b"data: x\r\r") == ([b"x"], b"")
    assert _events(b"data: x\r") == ([], b"data: x\r")  # maybe the first half of a CRLF


async def test_errors_and_saved_results_show_no_password() -> None:
    dead = ReplayConfig(url="http://sre:s3cret@127.0.0.1:1/v1", model="m", trace_block_size=BLOCK)
    from bench.replay import EndpointProblem

    with pytest.raises(EndpointProblem) as raised:
        await replay_async(dead, _trace())
    assert "s3cret" not in str(raised.value) and "sre:***@" in str(raised.value)
    from bench.replay.runner import ReplayResult

    keyed = ReplayResult([], 1.0, {"http://u:pw@vllm:8000/metrics": CacheCounters(0.0, 0.0)})
    assert "pw" not in json.dumps(summarize(keyed))
