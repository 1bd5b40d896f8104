"""The ``fleetgate`` command line: every subcommand, and the embedded stack behind ``fleetgate up``.

This package sits on top of everything else (gateway, replica, planning, bench) and nothing
imports it back: ``gateway/`` is the server alone.
"""
