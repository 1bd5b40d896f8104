"""How a relayed event stream says it is complete, or that the engine failed it.

A stream whose HTTP body ends properly can still be cut short (an ingress's idle timeout, an
engine shutting down gracefully): only the stream's own last event says it is whole. Each API
ends its streams its own way: chat and completions with ``data: [DONE]``; the Responses API
with the response's final state (``response.completed`` / ``incomplete`` / ``failed``, an SSE
``event:`` line and the data's ``"type"``); Anthropic's Messages with ``message_stop`` (vLLM
adds a ``[DONE]`` after it). An engine that fails a stream says so in it: the OpenAI envelope as
data (chat), or an ``error`` event (Responses, Messages); that ends it too.

Events are matched on their lines, never on bytes anywhere in them: a model's own text (``data:
[DONE]``, "response.completed") is inside a JSON string there, where its quotes are escaped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

_DONE: Final = (b"data: [DONE]", b"data:[DONE]")
_ERROR_DATA: Final = (b'data: {"error"', b'data:{"error"')
_Forms = tuple[tuple[bytes, ...], tuple[bytes, ...]]


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How one API's streams end: ``[DONE]``, or an event of one of ``final_types``."""

    #: The forms those types take on an event's lines (``stream_end`` builds them).
    finals: _Forms
    errors: _Forms
    #: Bytes one of which any such event holds: most events (tokens) are passed over on these.
    keys: tuple[bytes, ...]

    def classify(self, event: bytes) -> str | None:
        """``"end"`` for the stream's last event, ``"error"`` for the engine's error event, else
        None."""
        if not any(key in event for key in self.keys):
            return None
        for line in event.split(b"\n"):
            line = line.rstrip(b"\r")
            if line.startswith(_ERROR_DATA) or _has_type(line, self.errors):
                return "error"
            if line in _DONE or _has_type(line, self.finals):
                return "end"
        return None


def stream_end(*final_types: str) -> StreamEnd:
    """The ``StreamEnd`` of an API whose streams end with an event of one of ``final_types``
    (or ``[DONE]``)."""
    keys = (b"[DONE]", b"error", *(t.encode() for t in final_types))
    return StreamEnd(_type_forms(final_types), _type_forms(("error",)), keys)


def _type_forms(types: tuple[str, ...]) -> _Forms:
    events = tuple(f"event: {t}".encode() for t in types) + tuple(
        f"event:{t}".encode() for t in types
    )
    fields = tuple(f'"type":"{t}"'.encode() for t in types) + tuple(
        f'"type": "{t}"'.encode() for t in types
    )
    return events, fields


def _has_type(line: bytes, forms: _Forms) -> bool:
    events, fields = forms
    if line.startswith(b"event:"):
        return line.rstrip() in events
    # An escaped quote (\") inside a JSON string never reads as `"type":"...` (the backslash
    # stands between), so only the event's own field matches.
    return line.startswith(b"data:") and any(field in line for field in fields)


#: Chat and completions: ``data: [DONE]`` alone.
CHAT_STREAM_END: Final = stream_end()
