"""The aiohttp application of one simulated replica: every route it serves, in vLLM's shapes.

``server.py`` holds the replica and its core routes (completions, chat, models, LoRA, health,
metrics); ``api_server.py`` builds vLLM's other APIs (Responses, Anthropic Messages, embeddings,
detokenize …) on its request helpers. This module puts both together, so neither of them
imports the other back.
"""

from __future__ import annotations

from aiohttp import web

from replica.sim.api_server import add_api_routes
from replica.sim.server import SimServerConfig, build_core_app
from routing.tokenize.word_hash import SimTokenizer


def build_app(config: SimServerConfig, tokenizer: SimTokenizer | None = None) -> web.Application:
    """One simulated replica's application; ``app[REPLICA_KEY]`` once started.

    ``tokenizer`` lets several replicas share one loaded tokenizer.
    """
    app = build_core_app(config, tokenizer)
    add_api_routes(app)
    return app
