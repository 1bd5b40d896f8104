"""fleetgate's vLLM plugin, installed into the vLLM engine's environment.

Two entry points (see ``pyproject.toml`` and docs/vllm-plugin.md):

* ``vllm.general_plugins`` -> ``general.register``: imports the kernel-plugin modules listed in
  ``FLEETGATE_KERNEL_PLUGINS`` in every engine process and records them in Redis.
* ``vllm.stat_logger_plugins`` -> ``vllm_logger.FleetgateStatLogger``: pushes scheduler state
  (KV usage, running/waiting requests and adapters, preemptions) to Redis after engine steps,
  throttled, from a background thread.

Only ``vllm_logger`` imports vLLM; everything else imports without it (the gateway's venv and the
unit tests do not have vLLM).
"""
