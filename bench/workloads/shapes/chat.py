"""Multi-turn chat: sessions whose prompt is the whole conversation so far.

Turn ``t`` sends system prompt + user₁ + answer₁ + … + userₜ, so each turn's hash ids extend
the full blocks of the previous turn's (the previous turn's partial last block changes once
the answer fills it). Several sessions are open at once and their turns interleave.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.workloads.blocks import Segment
from bench.workloads.shapes.base import Shape, ShapedRequest

SYSTEM_PROMPT_TOKENS = 400
OPEN_SESSIONS = 32
MEAN_TURNS = 5
MAX_TURNS = 20


@dataclass
class _Session:
    turns_left: int
    history: list[Segment] = field(default_factory=list)


class MultiTurnChat(Shape):
    """Chat sessions of ~5 turns (geometric), prompts growing turn by turn."""

    name = "multi-turn"
    summary = (
        f"multi-turn chat: {OPEN_SESSIONS} interleaved sessions of ~{MEAN_TURNS} turns, "
        "each turn's prompt extends the previous one"
    )

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.sessions = [self._new_session() for _ in range(OPEN_SESSIONS)]

    def _new_session(self) -> _Session:
        # Geometric number of turns: most chats are short, a few go long.
        turns = 1
        while turns < MAX_TURNS and self.rng.random() > 1 / MEAN_TURNS:
            turns += 1
        return _Session(turns, [Segment("chat-system-prompt", SYSTEM_PROMPT_TOKENS)])

    def next_request(self) -> ShapedRequest:
        slot = self.rng.randrange(len(self.sessions))
        session = self.sessions[slot]
        session.history.append(self.unique("user", self.tokens(80, 0.8, 3, 2000)))
        prompt = tuple(session.history)
        answer = self.tokens(200, 0.7, 5, 2000)
        # The answer becomes part of the next turn's prompt.
        session.history.append(self.unique("answer", answer))
        session.turns_left -= 1
        if session.turns_left == 0:
            self.sessions[slot] = self._new_session()
        return ShapedRequest(prompt, output_length=answer)
