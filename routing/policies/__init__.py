"""Routing policies: one small module per plugin, registered by name in ``registry``.

Filters remove replicas that cannot serve; scorers rate replicas in [0, 1]; pickers order them.
The built-in policies (``expected-ttft``, ``cache-aware``, ``consistent-hash``, ``power-of-two``,
``least-loaded``, ``round-robin``, ``random``) are profiles composed from these plugins; see
``docs/policies/``.
"""
