"""Chained block hashes: deterministic, prefix-shaped, chain- and seed-dependent."""

from __future__ import annotations

import random

import numpy as np
import pytest

from routing.contracts import TokenizedPrompt
from routing.hashing import (
    chain_seed,
    extend_chain,
    hash_text_blocks,
    hash_token_blocks,
    prompt_chain,
)

BLOCK = 16
SEED = chain_seed("base-model")


def _tokens(count: int, rng_seed: int = 7) -> list[int]:
    rng = random.Random(rng_seed)
    return [rng.randrange(0, 150_000) for _ in range(count)]


def test_golden_values_pin_the_scheme() -> None:
    # Gateways of different versions share one Redis index: a silent change of the hashing scheme
    # would make them miss each other's entries. Changing these values needs a new scheme tag.
    seed = chain_seed("llama-3-8b", "support-bot", "tenant-a")
    assert seed == 4576278728319701539
    assert hash_token_blocks(list(range(48)), 16, seed) == [
        18191832877842816776,
        5563258739433307895,
        9820613169882872179,
    ]
    assert hash_text_blocks("hello world, this is fleetgate", 8, seed) == [
        17286949501876838008,
        9016516737055147281,
        10809023078223047884,
    ]


@pytest.mark.parametrize(
    "as_input",
    [
        list,
        tuple,
        lambda ids: np.asarray(ids, dtype=np.uint32),
        lambda ids: np.asarray(ids, dtype=np.int64),
        lambda ids: np.asarray(ids, dtype=np.int32),
    ],
    ids=["list", "tuple", "uint32", "int64", "int32"],
)
def test_every_input_type_gives_the_same_chain(as_input) -> None:
    tokens = _tokens(100)
    assert hash_token_blocks(as_input(tokens), BLOCK, SEED) == hash_token_blocks(
        tokens, BLOCK, SEED
    )


@pytest.mark.parametrize(
    ("length", "expected_blocks"),
    [(0, 0), (1, 0), (15, 0), (16, 1), (17, 1), (31, 1), (32, 2), (6000, 375)],
)
def test_only_full_blocks_are_hashed(length: int, expected_blocks: int) -> None:
    chain = hash_token_blocks(_tokens(length), BLOCK, SEED)
    assert len(chain) == expected_blocks
    assert all(0 <= value < 2**64 for value in chain)


def test_a_prefix_hashes_to_a_prefix_of_the_chain() -> None:
    tokens = _tokens(200)
    full = hash_token_blocks(tokens, BLOCK, SEED)
    for blocks in range(len(full) + 1):
        # Any tail after the last full block is ignored, so a few extra tokens change nothing.
        assert hash_token_blocks(tokens[: blocks * BLOCK + 3], BLOCK, SEED) == full[:blocks]


@pytest.mark.parametrize("changed_block", [0, 3, 11])
def test_a_change_alters_its_block_and_every_later_one(changed_block: int) -> None:
    tokens = _tokens(12 * BLOCK)
    altered = list(tokens)
    altered[changed_block * BLOCK + 5] += 1
    before = hash_token_blocks(tokens, BLOCK, SEED)
    after = hash_token_blocks(altered, BLOCK, SEED)
    assert after[:changed_block] == before[:changed_block]
    assert all(a != b for a, b in zip(after[changed_block:], before[changed_block:], strict=True))


def test_equal_blocks_under_different_parents_hash_differently() -> None:
    block = _tokens(BLOCK)
    chain = hash_token_blocks(block * 4, BLOCK, SEED)
    assert len(set(chain)) == 4


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("m", None, None), ("m2", None, None)),
        (("m", None, None), ("m", "adapter-a", None)),
        (("m", "adapter-a", None), ("m", "adapter-b", None)),
        (("m", None, None), ("m", None, "salt")),
        (("m", None, "tenant-1"), ("m", None, "tenant-2")),
        (("m", "a", None), ("m", None, "a")),
        # Length prefixes keep field boundaries apart.
        (("ab", "c", None), ("a", "bc", None)),
    ],
)
def test_seed_separates_models_adapters_and_tenants(left, right) -> None:
    seed_left, seed_right = chain_seed(*left), chain_seed(*right)
    assert seed_left != seed_right
    tokens = _tokens(64)
    assert not set(hash_token_blocks(tokens, BLOCK, seed_left)) & set(
        hash_token_blocks(tokens, BLOCK, seed_right)
    )


def test_empty_adapter_and_salt_mean_none() -> None:
    assert chain_seed("m", "", "") == chain_seed("m", None, None) == chain_seed("m")


def test_extend_chain_continues_a_chain_block_by_block() -> None:
    tokens = _tokens(10 * BLOCK)
    full = hash_token_blocks(tokens, BLOCK, SEED)
    assert extend_chain(None, tokens[: 3 * BLOCK], BLOCK, SEED) == full[:3]
    # One BlockStored event covering blocks 3..6, then one covering 7..9.
    assert extend_chain(full[2], tokens[3 * BLOCK : 7 * BLOCK], BLOCK, SEED) == full[3:7]
    assert extend_chain(full[6], tokens[7 * BLOCK :], BLOCK, SEED) == full[7:]


def test_text_blocks_are_prefix_shaped_and_apart_from_token_chains() -> None:
    text = "You are a helpful assistant. " * 10
    full = hash_text_blocks(text, 32, SEED)
    assert len(full) == len(text) // 32
    assert hash_text_blocks(text[: 2 * 32 + 5], 32, SEED) == full[:2]
    assert hash_text_blocks("é" * 64, 32, SEED) != hash_text_blocks("e" * 64, 32, SEED)
    # A text chain never collides with the token chain of the same code points.
    assert not set(full) & set(hash_token_blocks([ord(c) for c in text], 32, SEED))


def test_text_blocks_count_characters_not_bytes() -> None:
    assert len(hash_text_blocks("日本語" * 8, 8, SEED)) == 3


@pytest.mark.parametrize(
    ("prompt", "text_block_chars", "expected"),
    [
        (TokenizedPrompt(list(range(40))), None, hash_token_blocks(list(range(40)), 8, SEED)),
        (TokenizedPrompt(None, text="x" * 70), None, hash_text_blocks("x" * 70, 8 * 4, SEED)),
        (TokenizedPrompt(None, text="x" * 20), 8, hash_text_blocks("x" * 20, 8, SEED)),
        (TokenizedPrompt(token_ids=[], text=None), None, []),
    ],
    ids=["tokens", "text-default-4-chars-per-token", "text-explicit", "empty-tokens"],
)
def test_prompt_chain_picks_the_mode(
    prompt: TokenizedPrompt, text_block_chars: int | None, expected: list[int]
) -> None:
    chain = prompt_chain(prompt, 8, SEED, text_block_chars=text_block_chars)
    assert chain == expected
    assert prompt.token_ids is not None or len(chain) == len(prompt.text or "") // (
        text_block_chars or 32
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hash_token_blocks([1, 2], 0, SEED), "block_size must be a positive integer"),
        (lambda: hash_token_blocks([1, 2], True, SEED), "block_size must be a positive integer"),
        (lambda: hash_token_blocks([1, -2], 2, SEED), r"token ids must lie in \[0, 2\*\*32\)"),
        (lambda: hash_token_blocks([2**32], 2, SEED), r"token ids must lie in \[0, 2\*\*32\)"),
        (lambda: hash_token_blocks(np.array([-1]), 1, SEED), "got min -1"),
        (lambda: hash_token_blocks([1.5], 1, SEED), "sequence of integers"),
        (lambda: hash_token_blocks(np.ones((2, 2), int), 1, SEED), "one-dimensional"),
        (lambda: hash_token_blocks(np.ones(2), 1, SEED), "must be integers"),
        (lambda: hash_token_blocks([1], 1, -1), r"seed must be an int in \[0, 2\*\*64\)"),
        (lambda: hash_token_blocks([1], 1, 2**64), r"seed must be an int in \[0, 2\*\*64\)"),
        (lambda: extend_chain(-5, [1], 1, SEED), "parent must be an int"),
        (lambda: hash_text_blocks("abc", -1, SEED), "block_chars must be a positive integer"),
        (lambda: chain_seed(""), "model must be a non-empty string"),
        (lambda: prompt_chain(TokenizedPrompt(token_ids=None), 4, SEED), "neither token_ids"),
        (lambda: prompt_chain(TokenizedPrompt(None, text="ab"), 0, SEED), "block_size must be"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hash_text_blocks(b"abc", 2, SEED), "text must be a string"),
        (lambda: chain_seed("m", adapter=3), "adapter must be a string or None"),
    ],
)
def test_wrong_types_are_refused(call, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        call()
