"""One completion request, top to bottom: ``route`` → ``forward`` → ``account``.

- ``handler.py``: the aiohttp handler; runs the phases in order and turns errors into envelopes.
- ``kinds.py``: what differs between endpoints (chat, completion, ...): a ``RequestKind``.
- ``route.py``: admit (API key, rate limit), then route: model → route → tokens → replica.
  Hands on a ``RouteDecision``.
- ``forward.py``: a frozen ``ForwardPlan`` in, the answer relayed by ``gateway/proxy.py``, the
  ``UpstreamOutcome`` out; an ``AttemptRecorder`` keeps the per-attempt bookkeeping.
- ``account.py``: metrics, index feedback, calibration, and one ``DecisionRecord`` for
  ``/admin/decisions`` (``record.py``), written once.

``docs/gateway.md`` draws the path.
"""
