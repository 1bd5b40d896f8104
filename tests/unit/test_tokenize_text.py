"""TextTokenizer (approximate mode) and the tokenizer factory."""

from __future__ import annotations

import pytest

from routing.contracts import PromptTokenizer
from routing.hashing import chain_seed, prompt_chain
from routing.tokenize import (
    InvalidMessages,
    RemoteTokenizer,
    TextTokenizer,
    build_tokenizer,
    flatten_messages,
)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 4}
USER = {"role": "user", "content": "Summarise the attached report."}


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([USER], "<|user|>\nSummarise the attached report.\n"),
        ([{"role": "assistant", "content": None}], "<|assistant|>\n\n"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "<|user|>\na\nb\n",
        ),
        (
            [{"role": "tool", "tool_call_id": "7", "name": "search", "content": "42"}],
            '<|tool|>\n{"name": "search", "tool_call_id": "7"}\n42\n',
        ),
    ],
    ids=["plain", "null-content", "parts", "extra-fields-sorted"],
)
def test_flatten_messages(messages: list[dict[str, object]], expected: str) -> None:
    assert flatten_messages(messages) == expected


def test_flattening_ignores_key_order() -> None:
    one = {"role": "tool", "name": "a", "tool_call_id": "1", "content": "x"}
    other = {"content": "x", "tool_call_id": "1", "role": "tool", "name": "a"}
    assert flatten_messages([one]) == flatten_messages([other])


async def test_a_continued_conversation_keeps_its_text_prefix() -> None:
    text = TextTokenizer()
    first = await text.tokenize_chat("m", [SYSTEM, USER])
    second = await text.tokenize_chat(
        "m", [SYSTEM, USER, {"role": "assistant", "content": "Done."}, USER]
    )
    assert first.token_ids is None and second.text is not None
    assert second.text.startswith(first.text or "")
    seed = chain_seed("m")
    first_chain = prompt_chain(first, 4, seed)
    assert len(first_chain) > 3
    assert prompt_chain(second, 4, seed)[: len(first_chain)] == first_chain


async def test_completion_prompts_pass_through_as_text() -> None:
    prompt = await TextTokenizer().tokenize_completion("m", "Once upon a time")
    assert (prompt.token_ids, prompt.text, prompt.length) == (None, "Once upon a time", 16)


async def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt must be a string"):
        await TextTokenizer().tokenize_completion("m", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidMessages, match=r"messages\[0\]\.role"):
        await TextTokenizer().tokenize_chat("m", [{"content": "x"}])


async def test_factory_builds_each_kind() -> None:
    text = build_tokenizer("text")
    assert isinstance(text, TextTokenizer) and isinstance(text, PromptTokenizer)
    remote = build_tokenizer("remote", base_url="http://127.0.0.1:1", cache_size=8)
    assert isinstance(remote, RemoteTokenizer) and isinstance(remote, PromptTokenizer)
    await remote.close()


@pytest.mark.parametrize(
    ("kind", "opts", "message"),
    [
        ("local", {}, "needs model_dir"),
        ("remote", {}, "needs base_url"),
        ("text", {"x": 1}, "takes no options"),
        ("hf", {}, "must be 'local', 'remote' or 'text'"),
        ("remote", {"base_url": "ftp://x"}, "base_url must be an http"),
        ("remote", {"base_url": "http://x", "cache_size": -1}, "cache_size must be"),
        ("remote", {"base_url": "http://x", "timeout_s": 0}, "timeout_s must be"),
    ],
)
def test_factory_refuses_bad_configuration(
    kind: str, opts: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build_tokenizer(kind, **opts)  # type: ignore[arg-type]
