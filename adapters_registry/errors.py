"""Errors of the adapter registry, each carrying what the gateway needs to answer or retry.

``AdapterNotFound`` is the only one a client ever sees as such; it carries the exact envelope
fields of an unknown model so that a tenant cannot tell "does not exist" from "not yours".
The others tell the gateway to try another replica (``NoAdapterSlot``, ``ThrashGuardTripped``) or
that the engine refused the load (``AdapterLoadFailed``).
"""

from __future__ import annotations

from typing import Final

#: Envelope fields of an unknown model, as vLLM and the gateway answer them.
NOT_FOUND_TYPE: Final = "NotFoundError"
NOT_FOUND_CODE: Final = "model_not_found"


class AdapterError(Exception):
    """Base of every adapter-registry error."""


class AdapterNotFound(AdapterError):
    """Unknown adapter, or one the tenant may not use; the two are deliberately the same error.

    ``status``, ``message``, ``type`` and ``code`` are the OpenAI error envelope the gateway
    returns (HTTP 404), identical to an unknown base model's.
    """

    status: int = 404
    type: str = NOT_FOUND_TYPE
    code: str = NOT_FOUND_CODE
    param: str = "model"

    def __init__(self, name: str) -> None:
        self.name = name
        self.message = f"The model `{name}` does not exist."
        super().__init__(self.message)

    def envelope(self) -> dict[str, dict[str, str]]:
        """``{"error": {"message", "type", "code", "param"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }


class InvalidAdapter(AdapterError, ValueError):
    """A catalog entry (from the admin API or the policy) failed validation.

    ``errors`` lists each problem as ``field: reason (got value)``.
    """

    def __init__(self, name: str, errors: list[str]) -> None:
        self.name = name
        self.errors = errors
        super().__init__(f"adapter {name!r}: " + "; ".join(errors))


class AdapterLoadFailed(AdapterError):
    """The engine refused or failed a load (or it timed out); ``engine_message`` says why."""

    def __init__(
        self,
        adapter: str,
        replica: str,
        engine_message: str,
        status: int | None = None,
        unreachable: bool = False,
    ) -> None:
        self.adapter = adapter
        self.replica = replica
        self.engine_message = engine_message
        self.status = status
        #: The engine could not be reached at all (connection refused): the replica is down,
        #: not the adapter broken.
        self.unreachable = unreachable
        where = f"HTTP {status}: " if status is not None else ""
        super().__init__(
            f"loading adapter {adapter!r} on replica {replica!r} failed: {where}{engine_message}"
        )


class ReplicaLoadsFailing(AdapterLoadFailed):
    """Not tried: this replica's adapter loads have been failing (``load_failures.py``). The
    request falls back at once; a last resort tries anyway."""



class AdapterUnloadFailed(AdapterError):
    """The engine refused an unload; ``engine_message`` says why."""

    def __init__(
        self, adapter: str, replica: str, engine_message: str, status: int | None = None
    ) -> None:
        self.adapter = adapter
        self.replica = replica
        self.engine_message = engine_message
        self.status = status
        where = f"HTTP {status}: " if status is not None else ""
        super().__init__(
            f"unloading adapter {adapter!r} from replica {replica!r} failed: "
            f"{where}{engine_message}"
        )


class NoAdapterSlot(AdapterError):
    """Every slot on the replica holds a pinned adapter or one with requests in flight.

    The gateway should try another replica.
    """

    def __init__(self, adapter: str, replica: str, capacity: int, blocked: list[str]) -> None:
        self.adapter = adapter
        self.replica = replica
        self.capacity = capacity
        self.blocked = blocked
        super().__init__(
            f"no adapter slot for {adapter!r} on replica {replica!r}: all {capacity} slots hold "
            f"pinned or busy adapters ({', '.join(blocked) or 'none evictable'})"
        )


class OldWeightsInUse(NoAdapterSlot):
    """The replica holds the adapter's previous weights (a reload changed its ``source``) and
    requests admitted before the reload still use them: the new weights cannot be loaded there
    until they end (vLLM holds one set of weights per name). The gateway tries another replica.
    """

    def __init__(self, adapter: str, replica: str, requests: int) -> None:
        AdapterError.__init__(
            self,
            f"replica {replica!r} still serves {requests} request(s) with the previous weights "
            f"of {adapter!r}; its new weights cannot be loaded there until they end",
        )
        self.adapter = adapter
        self.replica = replica
        self.capacity = 0
        self.blocked = [adapter]


class ThrashGuardTripped(AdapterError):
    """The replica loaded too many adapters recently; the gateway should try another replica."""

    def __init__(self, adapter: str, replica: str, loads: int, limit: int, window_s: float):
        self.adapter = adapter
        self.replica = replica
        self.loads = loads
        self.limit = limit
        self.window_s = window_s
        super().__init__(
            f"thrash guard: replica {replica!r} already loaded {loads} adapters in the last "
            f"{window_s:g}s (limit {limit}); not loading {adapter!r} there"
        )
