"""Responses and Anthropic usages in the chat shape accounting reads (gateway.apis.usage)."""

from __future__ import annotations

from gateway.apis.usage import from_anthropic, from_responses


def test_responses_usage() -> None:
    usage = {"input_tokens": 120, "output_tokens": 7, "total_tokens": 127,
             "input_tokens_details": {"cached_tokens": 96, "cache_write_tokens": 0}}
    assert from_responses(usage) == {
        "prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127,
        "prompt_tokens_details": {"cached_tokens": 96},
    }
    assert from_responses(None) is None


def test_anthropic_input_tokens_exclude_cache_reads() -> None:
    usage = {"input_tokens": 24, "output_tokens": 7, "cache_read_input_tokens": 96}
    assert from_anthropic(usage) == {
        "prompt_tokens": 120, "completion_tokens": 7, "total_tokens": 127,
        "prompt_tokens_details": {"cached_tokens": 96},
    }


def test_anthropic_without_cache_fields_reports_no_cached_tokens() -> None:
    # vLLM without --enable-prompt-tokens-details: "not reported", not zero.
    assert from_anthropic({"input_tokens": 5, "output_tokens": 1}) == {
        "prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
    }


def test_anthropic_prompt_includes_cache_creation_tokens() -> None:
    # vLLM: input_tokens = prompt - cache_read - cache_creation (the real engines report both).
    usage = {"input_tokens": 32, "output_tokens": 3, "cache_read_input_tokens": 320,
             "cache_creation_input_tokens": 384}
    assert from_anthropic(usage) == {
        "prompt_tokens": 736, "completion_tokens": 3, "total_tokens": 739,
        "prompt_tokens_details": {"cached_tokens": 320},
    }
