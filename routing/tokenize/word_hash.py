"""Tokenizers for simulated replicas: a built-in deterministic one, or a real HF tokenizer.

Here rather than in ``replica/sim`` because two sides use it: the simulated replica tokenizes with
it, and the embedded gateway (``fleetgate up``, ``gateway/sim_tokenizer.py``) hashes the very same
token ids; the gateway must not import the simulator, and both may import ``routing``.

The built-in ``WordHashTokenizer`` needs no files: each whitespace-led word maps to a token id by
hashing it into the vocabulary (xxh3, so ids are stable across processes and machines). Equal text
gives equal ids, which is all prefix caching needs. It cannot decode arbitrary ids (hashing is
one-way), so generated text comes from ``FILLER_WORDS``, whose ids are known.

``HFTokenizer`` loads ``tokenizer.json`` (and the chat template from ``tokenizer_config.json``)
from a directory, so a simulated replica tokenizes exactly as a vLLM serving that model would.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import xxhash

from routing.tokenize.errors import TokenizationError
from routing.tokenize.local import LocalTokenizer
from routing.tokenize.messages import text_parts

#: Words the simulated model "generates"; a fixed list so outputs are reproducible.
FILLER_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
    "from", "this", "it", "an", "be", "are", "or", "which", "model", "token", "cache", "block",
    "replica", "prefix", "adapter", "tenant", "route", "latency", "queue", "batch", "prompt",
    "decode", "prefill", "memory", "request", "fleet", "router", "gateway", "engine", "score",
    "policy", "index", "throughput", "budget", "window", "stream", "event", "metric", "signal",
    "vector", "layer", "weight",
)

_PIECE = re.compile(r"\s*\S+")


class SimTokenizer(Protocol):
    """What the simulated replica needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (a completion prompt)."""
        ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` rendered through the chat template."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""
        ...

    def filler_token(self, request_seed: int, position: int) -> int:
        """The ``position``-th generated token of a request, deterministic in its seed."""
        ...


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(text_parts(content, strict=False))
    raise ValueError(f"message content must be a string or a list of parts (got {content!r})")


class WordHashTokenizer:
    """Whitespace-led words hashed into a fixed vocabulary; fast, file-free, deterministic."""

    #: Ids below this are reserved for special tokens (BOS and the chat-role markers).
    _FIRST_WORD_ID = 16
    BOS_ID = 1

    def __init__(self, vocab_size: int = 32_000) -> None:
        if vocab_size <= self._FIRST_WORD_ID + len(FILLER_WORDS):
            raise ValueError(f"vocab_size: must be > {self._FIRST_WORD_ID + len(FILLER_WORDS)}")
        self._vocab_size = vocab_size
        self._filler_ids = [self._piece_id(" " + word) for word in FILLER_WORDS]
        pairs = zip(self._filler_ids, FILLER_WORDS, strict=True)
        self._decode_table = {token_id: " " + word for token_id, word in pairs}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _piece_id(self, piece: str) -> int:
        span = self._vocab_size - self._FIRST_WORD_ID
        return self._FIRST_WORD_ID + xxhash.xxh3_64_intdigest(piece.encode()) % span

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._piece_id(piece) for piece in _PIECE.findall(text)]
        return [self.BOS_ID, *ids] if add_special_tokens else ids

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The built-in chat template: ``<|role|>`` then the content, one message per line."""
        parts = []
        for message in messages:
            role = message.get("role")
            if not isinstance(role, str):
                raise ValueError(f"every message needs a string 'role' (got {role!r})")
            parts.append(f"<|{role}|> {_content_text(message.get('content'))}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def decode(self, token_ids: Sequence[int]) -> str:
        # Ids that are not filler words cannot be inverted; show them as placeholders.
        return "".join(self._decode_table.get(t, f" <{t}>") for t in token_ids)

    def filler_token(self, request_seed: int, position: int) -> int:
        return self._filler_ids[_filler_index(request_seed, position, len(self._filler_ids))]


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` plus its chat template, loaded from a directory.

    Chat rendering is ``routing.tokenize.LocalTokenizer``'s, the gateway's own, so a gateway and
    a simulated replica given the same directory produce the same token ids.
    """

    def __init__(self, directory: str | Path) -> None:
        # Deferred: only needed with --tokenizer.
        from tokenizers import Tokenizer

        path = Path(directory)
        self._local = LocalTokenizer(path)
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        words = [self._tok.encode(" " + w, add_special_tokens=False).ids for w in FILLER_WORDS]
        self._filler_ids = [ids[0] for ids in words if ids] or [0]

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        try:
            text = self._local.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except TokenizationError as exc:  # no template, or the template refused the messages
            raise ValueError(str(exc)) from exc
        # Like vLLM: the template already places any BOS, so no special tokens are added.
        return self.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))

    def filler_token(self, request_seed: int, position: int) -> int:
        return self._filler_ids[_filler_index(request_seed, position, len(self._filler_ids))]


def _filler_index(request_seed: int, position: int, choices: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{request_seed}:{position}".encode()) % choices


def load_tokenizer(directory: str | Path | None = None) -> SimTokenizer:
    """``HFTokenizer(directory)`` when given, else the built-in ``WordHashTokenizer``."""
    if directory is None:
        return WordHashTokenizer()
    return HFTokenizer(directory)
