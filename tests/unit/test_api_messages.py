"""Responses and Anthropic bodies -> the chat messages vLLM renders (routing.api_messages)."""

from __future__ import annotations

import json

import pytest

from routing.api_messages import anthropic_messages, responses_messages


def test_responses_string_input_with_instructions() -> None:
    body = {"instructions": "Be brief.", "input": "hello"}
    assert responses_messages(body) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
    ]


def test_responses_items_parts_and_tool_calls() -> None:
    body = {
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "checking"}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
    }
    assert responses_messages(body) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]


def test_responses_previous_turn_drops_its_system_and_replays_the_answer() -> None:
    previous = [{"role": "system", "content": "old"}, {"role": "user", "content": "q1"}]
    body = {"instructions": "new", "input": "q2"}
    assert responses_messages(body, previous, ["a1"]) == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"type": "mystery"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"instructions": 1, "input": "x"}, "instructions"),
        ({"input": [{"type": "reasoning", "content": 5}]}, "input[0]"),
        ({"input": [{"type": "reasoning", "summary": {"text": "x"}}]}, "input[0]"),
    ],
)
def test_responses_bad_shapes_name_the_field(body: dict, path: str) -> None:
    with pytest.raises(ValueError, match=path.replace("[", r"\[").replace("]", r"\]")):
        responses_messages(body)


def test_anthropic_system_blocks_and_billing_header_dropped() -> None:
    body = {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: abc"},
                   {"type": "text", "text": "You are "}, {"type": "text", "text": "helpful."}],
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert anthropic_messages(body) == [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "hi"},
    ]


def test_anthropic_blocks_tool_use_and_result() -> None:
    body = {
        "system": "sys",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "checking"},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "sunny"}]},
            ]},
        ],
    }
    assert anthropic_messages(body) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "t1", "type": "function",
             "function": {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
    ]


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 1}]}, "messages[0].content"),
        ({"system": 1, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ],
)
def test_anthropic_bad_shapes_name_the_field(body: dict, path: str) -> None:
    with pytest.raises(ValueError, match=path.replace("[", r"\[").replace("]", r"\]")):
        anthropic_messages(body)
