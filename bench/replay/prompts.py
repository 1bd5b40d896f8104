"""Prompt text from trace hash ids: equal ids give equal text, one word ≈ one token.

Block ``h`` is ``trace_block_size`` words drawn deterministically (by ``h`` and position) from
``WORDS``: short, common, lower-case English words. Words are joined by single spaces, so every
word after the first is a space-led piece, which BPE tokenizers with the usual pre-tokenisation
(GPT-2/tiktoken style, Llama 3, Mistral, Qwen) and SentencePiece (``▁word``) alike encode as one
token each. The approximation: a block is *about* ``trace_block_size`` tokens on such tokenizers
(a word missing from a vocabulary costs two or three), and exactly that many on the simulated
replica's word tokenizer. Prefix sharing is exact either way: equal id prefixes give equal text
prefixes, hence equal token prefixes.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

__all__ = ["WORDS", "PromptText"]

#: Short, common words, each a single token in the usual LLM vocabularies (with a leading space).
_WORD_TEXT = """the of and to in is was for on that with as by at from this it an be are or which
    his her
    they we you he she not but all can had have has one two new more time year day way man world
    life hand part place case week work fact group number night point home water room mother
    area money story month lot right study book eye job word business issue side kind head house
    service friend father power hour game line end member law car city name team minute idea kid
    body back parent face others level office door health person art war history party result
    change morning reason research girl guy moment air teacher force education food street light
    river city land sea tree dog cat bird fish rain wind snow sun moon star road bridge train
    ship plane bank shop market price value cost plan model data code test rule form field table
    chair bed window wall floor garden park school class paper music film song voice sound color
    red blue green black white small large big long short high low good bad old young early late
    hard easy fast slow open close begin stop make take give find tell ask work seem feel try
    leave call keep let put mean become show hear play run move live believe hold bring write
    sit stand lose pay meet include continue set learn lead understand watch follow create speak
    read spend grow offer remember love consider appear buy wait serve die send expect build
    stay fall cut reach kill remain"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))


class PromptText:
    """Synthesises prompt text for trace records; caches recently used blocks' words."""

    #: Blocks kept (LRU): hot shared prefixes stay cached, one-off blocks pass through.
    CACHE_BLOCKS = 4096

    def __init__(self, trace_block_size: int = 512, seed: int = 0) -> None:
        if trace_block_size < 1:
            raise ValueError(f"trace_block_size must be >= 1 (got {trace_block_size})")
        self.trace_block_size = trace_block_size
        self.seed = seed & (2**64 - 1)
        self._blocks: OrderedDict[int, list[str]] = OrderedDict()

    def block_words(self, hash_id: int) -> list[str]:
        """The words of trace block ``hash_id`` (always ``trace_block_size`` of them)."""
        words = self._blocks.get(hash_id)
        if words is None:
            key = (hash_id & (2**64 - 1)).to_bytes(8, "little")
            seed = xxhash.xxh3_64_intdigest(key, self.seed)
            count = len(WORDS)
            words = [
                WORDS[xxhash.xxh3_64_intdigest(i.to_bytes(4, "little"), seed) % count]
                for i in range(self.trace_block_size)
            ]
            self._blocks[hash_id] = words
            if len(self._blocks) > self.CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(hash_id)
        return words

    def prompt(self, hash_ids: tuple[int, ...] | list[int], input_length: int) -> str:
        """A prompt of about ``input_length`` tokens made of the blocks ``hash_ids``.

        The last block is cut to the words that fit, as the trace's partial last block is.
        """
        words: list[str] = []
        remaining = input_length
        for hash_id in hash_ids:
            if remaining <= 0:
                break
            block = self.block_words(hash_id)
            words.extend(block[:remaining] if remaining < len(block) else block)
            remaining -= len(block)
        return " ".join(words)
