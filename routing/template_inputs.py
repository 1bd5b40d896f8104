"""What vLLM hands a chat template besides the messages, so the gateway renders the engine's prompt.

vLLM renders ``tools`` into the prompt (Llama 3.x, Qwen, Mistral and Hermes templates put the tool
schemas at or near the start), along with ``documents``, the request's ``add_generation_prompt`` /
``continue_final_message`` switches, ``reasoning_effort`` and the client's
``chat_template_kwargs``. A gateway that leaves any of them out hashes a different token sequence
from the first block on, and a tool-calling request then matches nothing it has cached.

Mirrors vLLM 0.32: ``ChatCompletionRequest.build_chat_params`` (the request's switches override
its ``chat_template_kwargs`` unless ``None`` or ``"auto"``), ``OnlineRenderer.preprocess_chat``
(the tools are defaults under both) and the tool dicts it renders:
``ChatCompletionToolsParam.model_dump`` for chat, the same shape built from an Anthropic tool
(``input_schema`` as ``parameters``) or a Responses function tool. Not modelled: vLLM's
``--exclude-tools-when-tool-choice-none`` (off by default) and a request ``chat_template``, which
vLLM refuses unless started with ``--trust-request-chat-template``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "anthropic_tools",
    "chat_template_variables",
    "openai_tools",
    "responses_tools",
    "template_variables",
]

ToolDict = dict[str, Any]

def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``merge_kwargs``: an override of ``None`` or ``"auto"`` leaves the default."""
    merged = dict(defaults)
    merged.update({k: v for k, v in overrides.items() if not (v is None or v == "auto")})
    return merged


def _function_tool(
    spec: Mapping[str, Any], path: str, parameters: Any, defer_loading: Any = None
) -> ToolDict:
    """vLLM's ``ChatCompletionToolsParam.model_dump()`` of a function ``spec`` (its name,
    description, strict): ``strict`` and ``defer_loading`` only where set."""
    name = spec.get("name")
    if not isinstance(name, str):
        raise ValueError(f"{path}.name: must be a string")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ValueError(f"{path}.parameters: must be an object")
    function: ToolDict = {
        "name": name,
        "description": spec.get("description"),
        "parameters": parameters,
    }
    if spec.get("strict") is not None:
        function["strict"] = spec["strict"]
    if defer_loading is None:
        defer_loading = spec.get("defer_loading")
    if defer_loading is not None:
        function["defer_loading"] = defer_loading
    return {"type": "function", "function": function}


def _objects(tools: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """(path, tool) of each entry of a ``tools`` array; ``ValueError`` for any other shape."""
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ValueError("tools: must be an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}]: must be an object")
        out.append((f"tools[{i}]", tool))
    return out


def openai_tools(tools: Any) -> list[ToolDict] | None:
    """A chat request's ``tools`` as the dicts vLLM gives the template (``None``: no tools)."""
    if tools is None:
        return None
    out = []
    for path, tool in _objects(tools):
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ValueError(f"{path}.function: must be an object")
        # vLLM copies the tool's defer_loading onto its function when the function has none,
        # and keeps it on the tool as well.
        defer = function.get("defer_loading")
        defer = tool.get("defer_loading") if defer is None else defer
        rendered = _function_tool(function, f"{path}.function", function.get("parameters"), defer)
        if tool.get("defer_loading") is not None:
            rendered["defer_loading"] = tool["defer_loading"]
        out.append(rendered)
    return out


def anthropic_tools(tools: Any) -> list[ToolDict] | None:
    """An Anthropic Messages request's ``tools`` as vLLM converts them for the chat template."""
    if tools is None:
        return None
    out = []
    for path, tool in _objects(tools):
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise ValueError(f"{path}.input_schema: must be an object")
        if "type" not in schema:
            schema = {**schema, "type": "object"}  # vLLM's default for a schema without one
        out.append(_function_tool(tool, path, schema))
    return out


#: vLLM's shim for a Responses ``custom`` tool (free-form text in): one string parameter.
_CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}


def responses_tools(tools: Any) -> list[ToolDict] | None:
    """A Responses request's tools as vLLM renders them (its ``get_function_tools``): function
    tools; a ``namespace``'s functions as ``<namespace>__<name>``; a ``custom`` tool as a
    function of one string ``input``. Built-in tools (web search, MCP, ...) are run by vLLM and
    never rendered: a request with only those renders an empty list, not no tools."""
    if not tools:
        return None
    out = []
    for path, tool in _objects(tools):
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool, path, tool.get("parameters")))
        elif kind == "custom":
            shim = {"name": tool.get("name"), "description": tool.get("description")}
            out.append(_function_tool(shim, path, _CUSTOM_TOOL_PARAMETERS))
        elif kind == "namespace":
            for inner_path, inner in _objects(tool.get("tools") or []):
                if inner.get("type") != "function":
                    continue
                flat = {**inner, "name": f"{tool.get('name')}__{inner.get('name')}"}
                out.append(_function_tool(flat, f"{path}.{inner_path}", inner.get("parameters")))
    return out


def template_variables(
    *,
    tools: list[ToolDict] | None,
    chat_template_kwargs: Any = None,
    add_generation_prompt: Any = True,
    continue_final_message: Any = False,
    documents: Any = None,
    reasoning_effort: Any = None,
) -> dict[str, Any]:
    """The variables the chat template sees besides ``messages``, merged as vLLM merges them."""
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise ValueError("chat_template_kwargs: must be an object")
    switches: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "documents": documents,
        "reasoning_effort": reasoning_effort,
    }
    if reasoning_effort is not None and "enable_thinking" not in chat_template_kwargs:
        # vLLM turns thinking on for templates that need an explicit opt-in (Gemma 4 ...).
        switches["enable_thinking"] = reasoning_effort != "none"
    request = _merge(chat_template_kwargs, switches)
    return _merge({"tools": tools}, request)


def chat_template_variables(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template variables of an OpenAI chat request body."""
    return template_variables(
        tools=openai_tools(body.get("tools")),
        chat_template_kwargs=body.get("chat_template_kwargs"),
        add_generation_prompt=body.get("add_generation_prompt", True),
        continue_final_message=body.get("continue_final_message", False),
        documents=body.get("documents"),
        reasoning_effort=body.get("reasoning_effort"),
    )
