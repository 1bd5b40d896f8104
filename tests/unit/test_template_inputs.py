"""The chat template's inputs besides the messages (tools, documents, switches), as vLLM merges.

A tool-calling request whose tools the gateway leaves out of the rendered prompt hashes a different
token sequence from its first block on, and matches nothing the engines cached.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from gateway.apis import anthropic, responses
from gateway.request.kinds import CHAT
from routing.template_inputs import (
    anthropic_tools,
    chat_template_variables,
    openai_tools,
    responses_tools,
    template_variables,
)
from routing.tokenize import LocalTokenizer
from routing.tokenize.remote import tokenize_chat_body
from tests.unit.test_tokenize_local import MESSAGES, write_model_dir

#: Renders the tools first, as Llama 3.x, Qwen and Hermes templates do.
TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>\n"
    "{% endif %}"
    "{% if documents %}<|system|>{{ documents | tojson }}<|end|>\n{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}<|system|>no think<|end|>\n"
    "{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "x-vendor": "dropped by vLLM's model",
    },
}


@pytest.fixture
def local(tmp_path: Path) -> LocalTokenizer:
    from tests.unit.test_tokenize_local import train_tokenizer

    trained: Tokenizer = train_tokenizer()
    return LocalTokenizer(write_model_dir(tmp_path, trained, chat_template=TOOLS_TEMPLATE))


def test_openai_tools_are_vllms_tool_dicts() -> None:
    # ChatCompletionToolsParam.model_dump(): type, then the function's name, description (None
    # kept), parameters; strict and defer_loading only when set; unknown fields dropped.
    assert openai_tools([WEATHER]) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": None,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    strict = {"type": "function", "function": {"name": "f", "strict": True}, "defer_loading": True}
    assert openai_tools([strict]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": None,
                "parameters": None,
                "strict": True,
                "defer_loading": True,
            },
            "defer_loading": True,  # vLLM keeps it on the tool too
        }
    ]
    assert openai_tools(None) is None
    for bad, where in (
        ("nope", "tools"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"function": {"name": 3}}], "tools[0].function.name"),
        ([{"function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(where)):
            openai_tools(bad)


def test_anthropic_and_responses_tools_take_the_same_shape() -> None:
    expected = openai_tools([WEATHER])
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    assert anthropic_tools([{"name": "get_weather", "input_schema": schema}]) == expected
    # vLLM gives a schema without a type "object".
    no_type = anthropic_tools([{"name": "f", "input_schema": {"properties": {}}}])
    assert no_type is not None and no_type[0]["function"]["parameters"]["type"] == "object"
    assert responses_tools(
        [
            {"type": "function", "name": "get_weather", "parameters": schema},
            {"type": "web_search"},  # a built-in tool: vLLM runs it, the template never sees it
        ]
    ) == expected
    # Only built-in tools: vLLM renders an empty list (templates test `tools is not none`).
    assert responses_tools([{"type": "web_search"}]) == []
    assert responses_tools([]) is None
    # A custom tool is a function of one free-form string; a namespace's functions are flat.
    (custom,) = responses_tools([{"type": "custom", "name": "apply_patch", "description": "d"}])
    assert custom["function"]["name"] == "apply_patch"
    assert custom["function"]["parameters"]["required"] == ["input"]
    flat = responses_tools(
        [{"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "read"}]}]
    )
    assert flat is not None and flat[0]["function"]["name"] == "mcp__read"
    with pytest.raises(ValueError, match=r"tools\[0\]\.input_schema"):
        anthropic_tools([{"name": "f"}])


def test_switches_override_the_clients_template_kwargs_as_vllm_merges_them() -> None:
    variables = template_variables(
        tools=None,
        chat_template_kwargs={"add_generation_prompt": False, "enable_thinking": True, "x": 1},
        reasoning_effort="none",
    )
    # The request's own switch wins over chat_template_kwargs; a kwarg the client set itself is
    # not overridden by the reasoning effort's derived enable_thinking.
    assert variables["add_generation_prompt"] is True
    assert variables["enable_thinking"] is True and variables["x"] == 1
    assert variables["reasoning_effort"] == "none"
    assert template_variables(tools=None, reasoning_effort="none")["enable_thinking"] is False
    # None and "auto" leave the default in place; the client's kwargs can replace the tools.
    assert template_variables(tools=[{"a": 1}], documents=None)["tools"] == [{"a": 1}]
    replaced = template_variables(tools=[{"a": 1}], chat_template_kwargs={"tools": []})
    assert replaced["tools"] == []
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        template_variables(tools=None, chat_template_kwargs=[1])


async def test_tools_documents_and_thinking_render_into_the_chat_prompt(
    local: LocalTokenizer,
) -> None:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES}
    plain = await CHAT.prompt(local, "m", body)
    with_tools = await CHAT.prompt(local, "m", {**body, "tools": [WEATHER]})
    text = local.render_chat(MESSAGES, **chat_template_variables({**body, "tools": [WEATHER]}))
    assert text.startswith(
        '<s><|system|>{"type": "function", "function": {"name": "get_weather", '
        '"description": null, "parameters": {"type": "object"'
    )
    assert "x-vendor" not in text
    assert len(with_tools.token_ids or ()) > len(plain.token_ids or ()) + 10
    documents = await CHAT.prompt(local, "m", {**body, "documents": [{"title": "t"}]})
    thinking_off = await CHAT.prompt(local, "m", {**body, "reasoning_effort": "none"})
    variants = (plain, with_tools, documents, thinking_off)
    assert len({tuple(p.token_ids or ()) for p in variants}) == 4
    # The Messages and Responses APIs render their tools the same way.
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    messages_body = {
        "model": "m",
        "max_tokens": 5,
        "system": MESSAGES[0]["content"],
        "messages": [MESSAGES[1]],
        "tools": [{"name": "get_weather", "input_schema": schema}],
    }
    from_messages = await anthropic.prompt(local, "m", messages_body)
    assert list(from_messages.token_ids or ()) == list(with_tools.token_ids or ())
    responses_body = {
        "model": "m",
        "instructions": MESSAGES[0]["content"],
        "input": MESSAGES[1]["content"],
        "tools": [{"type": "function", "name": "get_weather", "parameters": schema}],
    }
    from_responses = await responses.prompt(local, "m", responses_body)
    assert list(from_responses.token_ids or ()) == list(with_tools.token_ids or ())


async def test_continue_final_message_leaves_the_last_turn_open(local: LocalTokenizer) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "It naps in the"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    text = local.render_chat(messages, **chat_template_variables(body))
    assert text.endswith("<|assistant|>It naps in the")  # no <|end|>: the model goes on


def test_remote_tokenize_body_uses_vllms_fields() -> None:
    variables = chat_template_variables(
        {"tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}}
    )
    body = tokenize_chat_body("m", MESSAGES, variables)
    # /tokenize takes tools and the two switches as its own fields; every other template
    # variable must travel inside chat_template_kwargs (a top-level one is ignored).
    assert body == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "tools": openai_tools([WEATHER]),
        "chat_template_kwargs": {"enable_thinking": False},
        "model": "m",
        "messages": MESSAGES,
    }
