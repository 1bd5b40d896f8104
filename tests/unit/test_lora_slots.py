"""``routing.lora_slots``: the one reading of vLLM's ``lora_requests_info`` gauge that the
gateway's poll, the replica agent's scrape and the flag advisor share."""

from __future__ import annotations

from gateway.replicas import parse_lora_info
from planning.advise.engine_metrics import parse_engine_metrics
from replica.agent.scrape import parse_metrics
from routing.lora_slots import LoraInfo, latest_lora_info

# The gauge as vLLM leaves it after adapters came and went: one sample per label set ever set,
# each valued with the time it was set; the latest is the current state.
_GAUGE = "vllm:lora_requests_info"
REAL_FORMAT = "\n".join([
    f"# HELP {_GAUGE} Running stats on lora requests.",
    f"# TYPE {_GAUGE} gauge",
    f'{_GAUGE}{{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}} 1.7330e+09',
    f'{_GAUGE}{{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="law"}}'
    " 1.7330000050e+09",
    f'{_GAUGE}{{max_lora="2",running_lora_adapters="sql",waiting_lora_adapters=""}}'
    " 1.7330000020e+09",
    "",
])


def test_latest_sample_wins_whatever_its_order() -> None:
    samples = [({"max_lora": "4", "running_lora_adapters": "a"}, 2.0),
               ({"max_lora": "4", "running_lora_adapters": "b,c"}, 3.0),
               ({"max_lora": "4", "running_lora_adapters": "d"}, 1.0)]
    assert latest_lora_info(samples) == LoraInfo(4, frozenset({"b", "c"}))
    assert latest_lora_info([]) is None


def test_unknown_slot_count_is_none() -> None:
    for raw in ("", "None", "many"):
        assert LoraInfo.from_labels({"max_lora": raw}).max_loras is None


def test_gateway_agent_and_advisor_read_the_gauge_alike() -> None:
    expected = LoraInfo(2, frozenset({"sql", "chat"}), frozenset({"law"}))
    assert parse_lora_info(REAL_FORMAT) == expected
    scraped = parse_metrics(REAL_FORMAT)
    assert LoraInfo(
        scraped["max_loras"], scraped["running_adapters"], scraped["waiting_adapters"]
    ) == expected
    advised = parse_engine_metrics(REAL_FORMAT)
    assert (advised.max_lora, advised.adapters) == (2, expected.running | expected.waiting)
