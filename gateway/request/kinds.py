"""What differs between the OpenAI endpoints the gateway routes: one ``RequestKind`` each.

A kind says how to check the body, what text to route on (how to tokenize it the way vLLM will),
where the replica serves it, and whether its prompt is prefix-routed at all. Everything else
(admission, routing, forwarding, accounting) is the same for every kind. To add an endpoint,
write its ``RequestKind`` here and mount ``handler.handle(request, KIND)`` in ``gateway/app.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.request_body import (
    prompt_embeds_only,
    validate_chat,
    validate_common,
    validate_completion,
)
from gateway.stream_end import CHAT_STREAM_END, StreamEnd
from routing.contracts import PromptTokenizer, TokenizedPrompt
from routing.hashing import CHARS_PER_TOKEN
from routing.template_inputs import chat_template_variables

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.errors import GatewayError
    from gateway.policy_view import Tenant
    from gateway.proxy import UpstreamOutcome
    from gateway.state import GatewayState
    from routing.types import ReplicaId

Body = Mapping[str, Any]
#: Checks the fields the gateway reads; raises ``GatewayError`` (400) on bad input.
BodyCheck = Callable[[Body], None]
#: What vLLM will tokenize for this body, through ``tokenizer``, for base model ``model``.
PromptOf = Callable[[PromptTokenizer, str, Body], Awaitable[TokenizedPrompt]]
#: The body with the gateway-owned fields this API needs (run once, after the check).
BodyPrep = Callable[[dict[str, Any]], dict[str, Any]]
#: (body, the client's bytes, tenant) -> (the bytes the replica gets, hide the usage chunk).
PayloadOf = Callable[[Body, bytes, "Tenant"], tuple[bytes, bool]]
#: The answer's ``usage`` in the chat shape accounting reads.
UsageOf = Callable[[Mapping[str, Any] | None], Mapping[str, Any] | None]
#: A gateway error as this API's clients expect it (its own envelope).
ErrorOf = Callable[["GatewayError", str], "web.Response"]
#: The one replica this request must go to, whatever the policy says (or None: route it).
PinOf = Callable[["GatewayState", "Tenant", Body], Awaitable["ReplicaId | None"]]
#: Told which replica is about to serve, or served, the request (before its answer is relayed).
ServedBy = Callable[["GatewayState", "Tenant", Body, "ReplicaId"], Awaitable[None]]
#: The in-band SSE event that tells a client its started stream failed, in this API's shape,
#: given the last event relayed before it.
StreamErrorOf = Callable[["GatewayError", bytes], bytes]
#: (body, outcome, the answer relayed) -> the id of a response the engine goes on generating
#: after it answered (a background Response), to account when it ends; None: it has ended.
FinishesLaterOf = Callable[[Body, "UpstreamOutcome", "web.StreamResponse | None"], "str | None"]


@dataclass(frozen=True, slots=True)
class RequestKind:
    """One endpoint's request shape (see the module doc)."""

    #: Short name, for spans and logs ("chat", "completion").
    name: str
    #: The replica's path for it (the same path vLLM serves).
    upstream_path: str
    validate: BodyCheck
    #: The prompt to route on. Ignored when ``prefix_routed`` is False.
    prompt: PromptOf
    #: False: no prompt blocks to match (routing on load alone, no speculative index write).
    prefix_routed: bool = True
    #: False: the endpoint never streams (embeddings, pooling, tokenize): a client's
    #: ``"stream": true`` there is ignored, as vLLM ignores it, and the answer is relayed and
    #: accounted as the JSON body it is.
    streams: bool = True
    # The hooks below let an API that is not chat-shaped (``gateway/apis/``: Responses,
    # Anthropic Messages, embeddings) use the same path; None keeps chat's behaviour.
    prepare: BodyPrep | None = None
    #: None: chat's (``forward.upstream_payload``: the tenant's salt, the stream's usage chunk).
    payload: PayloadOf | None = None
    usage: UsageOf | None = None
    #: None: the OpenAI envelope.
    error_response: ErrorOf | None = None
    #: None: ``data: {"error": ...}`` (the OpenAI envelope as one event).
    stream_error: StreamErrorOf | None = None
    pinned_replica: PinOf | None = None
    served_by: ServedBy | None = None
    #: Bytes any of which mark a stream event carrying output tokens; events before the first
    #: such one (Responses' ``response.created``) do not end the time to first token. None: any
    #: event.
    first_token_marker: tuple[bytes, ...] | None = None
    #: How a complete stream ends (``gateway/stream_end.py``): one that ends otherwise was cut
    #: short and gets the in-band error. Chat's and completions' ``data: [DONE]``.
    stream_end: StreamEnd = CHAT_STREAM_END
    finishes_later: FinishesLaterOf | None = None
    #: The prompt tokens a token budget reserves up front, given the routed prompt's count
    #: (``budget_prompt_tokens``); None: the routed prompt's. The engine's own count settles it
    #: when the request ends.
    budget_prompt: BudgetPromptOf | None = None


#: (body, the routed prompt's tokens) -> the prompt tokens the request's budget reserves.
BudgetPromptOf = Callable[[Body, int], int]


def estimated_input_tokens(value: Any) -> int:
    """A rough count of the tokens in a request's inputs, for a token budget's up-front
    reservation where the gateway tokenizes nothing (embeddings, pooling, a batch's other
    prompts): every string at about ``CHARS_PER_TOKEN`` characters a token, every integer in a
    list (token ids) one token. The engine's count replaces it when the request ends."""
    if isinstance(value, str):
        if value.startswith(_NOT_TEXT):
            # An image or audio clip, inline (base64) or by URL: its tokens are the encoder's,
            # not its characters / 4 (one inline image read as 75,000 tokens and was refused as
            # over a whole budget, the diff review found). The engine's count settles it.
            return 0
        return -(-len(value) // CHARS_PER_TOKEN)
    if isinstance(value, Mapping):
        return sum(estimated_input_tokens(v) for k, v in value.items() if k not in _NOT_INPUT)
    if isinstance(value, list):
        return sum(
            1 if isinstance(v, int) and not isinstance(v, bool) else estimated_input_tokens(v)
            for v in value
        )
    return 0


#: How a string that is media, not text, starts (data URLs, links to media).
_NOT_TEXT = ("data:", "http://", "https://", "file:")

#: Fields of a body that are settings, not input.
_NOT_INPUT = frozenset({"model", "encoding_format", "user", "input_type", "truncation_side"})


def batch_prompt_tokens(body: Body, routed_tokens: int) -> int:
    """A completions batch is routed on its first prompt; its budget counts them all."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return routed_tokens + sum(estimated_input_tokens(p) for p in prompt[1:])
    return routed_tokens


def whole_input_tokens(body: Body, routed_tokens: int) -> int:
    """An API the gateway does not tokenize: its whole input, estimated."""
    return max(routed_tokens, estimated_input_tokens(body))


def _validate_chat(body: Body) -> None:
    validate_common(body)
    validate_chat(body)


def _validate_completion(body: Body) -> None:
    validate_common(body)
    validate_completion(body)


async def _chat_prompt(tokenizer: PromptTokenizer, model: str, body: Body) -> TokenizedPrompt:
    variables = chat_template_variables(body)  # tools and switches render into the prompt too
    return await tokenizer.tokenize_chat(model, body["messages"], **variables)


async def _completion_prompt(tokenizer: PromptTokenizer, model: str, body: Body) -> TokenizedPrompt:
    if prompt_embeds_only(body):  # embeddings in, no text: nothing to hash, routed by load
        return TokenizedPrompt(token_ids=[])
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return await tokenizer.tokenize_completion(model, prompt)
    if isinstance(prompt[0], str):  # a batch goes to one replica: route on its first prompt
        return await tokenizer.tokenize_completion(model, prompt[0])
    if isinstance(prompt[0], int):
        return TokenizedPrompt(token_ids=list(prompt))
    return TokenizedPrompt(token_ids=list(prompt[0]))


CHAT = RequestKind("chat", "/v1/chat/completions", _validate_chat, _chat_prompt)
COMPLETION = RequestKind(
    "completion", "/v1/completions", _validate_completion, _completion_prompt,
    budget_prompt=batch_prompt_tokens,
)
