"""Agents: a few shared few-shot prefixes, then a task that grows with each tool call.

Every agent step re-sends few-shot prefix + task + all previous (action, tool output) pairs;
outputs are short (the next action). The few-shot prefixes are the cacheable part; tool
outputs are unique and large, which makes agents prefill-heavy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.workloads.blocks import Segment
from bench.workloads.shapes.base import Shape, ShapedRequest, Zipf

FEW_SHOT_PREFIXES = 4
OPEN_TASKS = 16
MAX_STEPS = 8


@dataclass
class _Task:
    steps_left: int
    history: list[Segment]


class FewShotAgent(Shape):
    """Tool-using agents on one of a few few-shot prefixes; 2–8 steps per task."""

    name = "agent"
    summary = (
        f"agents: {FEW_SHOT_PREFIXES} shared few-shot prefixes, tasks of 2-{MAX_STEPS} steps "
        "that append tool outputs"
    )

    def __init__(self, rng: random.Random) -> None:
        super().__init__(rng)
        self.prefix_tokens = [self.tokens(2500, 0.4, 800, 8000) for _ in range(FEW_SHOT_PREFIXES)]
        # Some agent types (prefixes) are much busier than others.
        self.prefixes = Zipf(range(FEW_SHOT_PREFIXES), exponent=1.0)
        self.tasks = [self._new_task() for _ in range(OPEN_TASKS)]

    def _new_task(self) -> _Task:
        prefix = int(self.prefixes.pick(self.rng))
        history = [
            Segment(("few-shot", prefix), self.prefix_tokens[prefix]),
            self.unique("task", self.tokens(150, 0.5, 20, 1000)),
        ]
        return _Task(self.rng.randint(2, MAX_STEPS), history)

    def next_request(self) -> ShapedRequest:
        slot = self.rng.randrange(len(self.tasks))
        task = self.tasks[slot]
        prompt = tuple(task.history)
        action = self.tokens(80, 0.5, 10, 600)
        task.history.append(self.unique("action", action))
        task.history.append(self.unique("tool-output", self.tokens(600, 1.0, 20, 6000)))
        task.steps_left -= 1
        if task.steps_left == 0:
            self.tasks[slot] = self._new_task()
        return ShapedRequest(prompt, output_length=action)
