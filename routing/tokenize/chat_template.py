"""Rendering a model's Jinja chat template the way Hugging Face (and so vLLM) renders it.

Templates come from model repositories, which are not trusted code: they run in Jinja's
immutable sandbox. The environment mirrors the one ``transformers`` builds (trim/lstrip blocks,
loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text and
a ``{% generation %}`` block), so the same template yields the same text, and the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from routing.tokenize.errors import TokenizationError

__all__ = ["ChatTemplate"]


def _raise_exception(message: str) -> None:
    """Templates call this to refuse a conversation (e.g. roles out of order)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and forces ASCII; templates expect plain JSON.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    rendering for inference outputs its body unchanged."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special tokens its ``tokenizer_config.json`` names."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template must be a non-empty string")
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: line {exc.lineno}: {exc}") from exc
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for ``messages``; ``template_kwargs`` (``tools``, ...) pass through."""
        context: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        context["messages"] = messages
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**context)
        except jinja2.TemplateError as exc:
            raise TokenizationError(f"chat template refused the messages: {exc}") from exc
