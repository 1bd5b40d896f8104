"""Workload shapes by CLI name. Each shape is one module; add new ones to ``SHAPES``."""

from __future__ import annotations

from bench.workloads.shapes.agent import FewShotAgent
from bench.workloads.shapes.base import Shape, ShapedRequest
from bench.workloads.shapes.chat import MultiTurnChat
from bench.workloads.shapes.lora import B2BLora
from bench.workloads.shapes.rag import RagCacheBuster, RagChatbot

SHAPES: dict[str, type[Shape]] = {
    shape.name: shape
    for shape in (RagChatbot, RagCacheBuster, MultiTurnChat, FewShotAgent, B2BLora)
}

__all__ = ["SHAPES", "Shape", "ShapedRequest"]
