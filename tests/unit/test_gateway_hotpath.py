"""The gateway's hot path: upstream bodies from raw bytes, text-mode units, bounded structures."""

from __future__ import annotations

import json

from gateway.cost import RouteWindow
from gateway.layout import BoundedSet, LayoutDiagnostics, block_content_hashes
from gateway.metrics import GatewayMetrics
from gateway.policy_view import Tenant
from gateway.request.forward import upstream_body, upstream_payload
from gateway.request.route import prompt_units
from routing.contracts import TokenizedPrompt
from routing.hashing import chain_seed, prompt_chain

PLAIN = Tenant("t")
SALTED = Tenant("t", cache_salt='s3cr"et')


def _payload(body: dict, tenant: Tenant, raw: bytes | None = None) -> tuple[bytes, bool]:
    raw = json.dumps(body).encode() if raw is None else raw
    return upstream_payload(body, raw, tenant)


def test_unchanged_body_is_forwarded_as_the_clients_bytes() -> None:
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi \\u00e9"}]}\n'
    payload, hide = _payload(json.loads(raw), PLAIN, raw)
    assert payload is raw and not hide


def test_payload_matches_upstream_body_in_every_case() -> None:
    cases = [
        ({"model": "m", "prompt": "x"}, PLAIN),
        ({"model": "m", "prompt": "x"}, SALTED),
        ({"model": "m", "prompt": "x", "cache_salt": "forged"}, PLAIN),
        ({"model": "m", "prompt": "x", "cache_salt": "forged"}, SALTED),
        ({"model": "m", "prompt": "x", "stream": True}, PLAIN),
        ({"model": "m", "prompt": "x", "stream": True}, SALTED),
        ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"x": 1}}, PLAIN),
        (
            {
                "model": "m",
                "prompt": "x",
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            SALTED,
        ),
        ({"model": "m", "prompt": "x", "stream": False, "stream_options": {"x": 1}}, PLAIN),
    ]
    for body, tenant in cases:
        payload, hide = _payload(body, tenant)
        expected, expected_hide = upstream_body(body, tenant)
        assert json.loads(payload) == expected, (body, tenant)
        assert hide == expected_hide


def test_continuous_usage_is_not_switched_on_by_the_gateways_own_usage_request() -> None:
    # vLLM sends per-chunk usage only with include_usage. The gateway asks for include_usage to
    # read cached_tokens; that must not turn on the usage a client asked for without it.
    asked = {"model": "m", "prompt": "x", "stream": True,
             "stream_options": {"continuous_usage_stats": True}}
    payload, hide = _payload(asked, PLAIN)
    assert hide and json.loads(payload)["stream_options"] == {"include_usage": True}
    both = {**asked, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    payload, hide = _payload(both, PLAIN)
    assert not hide and json.loads(payload)["stream_options"] == both["stream_options"]


def test_text_mode_prompt_units_are_estimated_tokens_consistent_with_blocks() -> None:
    text = "word " * 1180  # 5,900 characters
    prompt = TokenizedPrompt(token_ids=None, text=text)
    chain = prompt_chain(prompt, 16, chain_seed("m"))
    tokens = prompt_units(prompt)
    assert tokens == 1475  # characters / CHARS_PER_TOKEN, rounded up
    # A replica holding every block holds (nearly) the whole prompt, in the same units.
    assert len(chain) * 16 <= tokens < (len(chain) + 1) * 16
    assert prompt_units(TokenizedPrompt(token_ids=[1, 2, 3])) == 3


def test_text_mode_content_blocks_have_the_chains_geometry() -> None:
    prompt = TokenizedPrompt(token_ids=None, text="abcdefgh" * 500)
    assert len(block_content_hashes(prompt, 16)) == len(prompt_chain(prompt, 16, chain_seed("m")))


def test_well_laid_out_text_prompt_is_not_flagged() -> None:
    layout = LayoutDiagnostics()
    system = " ".join(f"rule{i} keep answers short and precise." for i in range(120))
    for i in range(60):
        text = f"system: {system}\nuser: question number {i} about topic {i * 7919}?"
        prompt = TokenizedPrompt(token_ids=None, text=text)
        layout.observe("r", prompt, prompt_chain(prompt, 16, chain_seed("m")), 16)
    (report,) = layout.reports()
    assert not report.cache_busting_layout
    assert 0.5 < report.prefix_repeat_fraction <= 1.0
    assert report.content_repeat_after_miss_fraction <= 1.0


def test_unique_first_text_prompt_is_flagged() -> None:
    layout = LayoutDiagnostics()
    system = " ".join(f"rule{i} keep answers short and precise." for i in range(120))
    for i in range(60):
        # The unique stamp is a whole text block (64 characters) ahead of the shared part.
        text = f"{i:064d}{system}"
        prompt = TokenizedPrompt(token_ids=None, text=text)
        layout.observe("r", prompt, prompt_chain(prompt, 16, chain_seed("m")), 16)
    (report,) = layout.reports()
    assert report.cache_busting_layout
    assert report.content_repeat_after_miss_fraction <= 1.0


def test_layout_sampling_and_bounded_sketches() -> None:
    layout = LayoutDiagnostics(sketch_capacity=1000, sample_every=4, full_requests=10)
    for i in range(410):
        prompt = TokenizedPrompt(token_ids=[i * 100 + t for t in range(64)])
        layout.observe("r", prompt, prompt_chain(prompt, 16, chain_seed("m")), 16)
    (report,) = layout.reports()
    assert report.requests == 10 + 100  # all of the first 10, then one in 4
    state = layout._routes["r"]
    assert len(state.chained) <= 1000 and len(state.content) <= 1000


def test_bounded_set_keeps_what_repeats() -> None:
    sketch = BoundedSet(100)
    for i in range(10_000):
        sketch.update([-1, i])  # -1 repeats with every batch
        assert -1 in sketch
    assert len(sketch) <= 100 and 9_999 in sketch and 0 not in sketch


def test_route_window_memory_is_per_second_not_per_request() -> None:
    now = [0.0]
    window = RouteWindow(window_s=60, clock=lambda: now[0])
    for i in range(10_000):
        now[0] = i / 100  # 100 requests a second for 100 s
        window.add("r", "p", 0.01, prompt_tokens=100, cached_tokens=50, completion_tokens=1)
    assert len(window._buckets) <= 61
    assert window.hit_rates() == {"r": 0.5}


def test_metric_children_are_reused() -> None:
    metrics = GatewayMetrics()
    first = metrics.requests.labels("r", "m", "x", "200")
    assert metrics.requests.labels("r", "m", "x", "200") is first
    first.inc()
    sample = metrics.registry.get_sample_value(
        "fleetgate_requests_total", {"route": "r", "model": "m", "replica": "x", "status": "200"}
    )
    assert sample == 1.0
