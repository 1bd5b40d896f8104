"""The plugin's logger.

It lives under vLLM's ``vllm`` logger on purpose: vLLM configures a handler and level only for
that tree, so a logger named ``fleetgate…`` would lose its INFO lines inside an engine process.
Outside vLLM (unit tests) it is an ordinary logger.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "logger"]

LOGGER_NAME = "vllm.fleetgate_plugin"
logger = logging.getLogger(LOGGER_NAME)
