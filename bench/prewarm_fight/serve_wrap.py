"""`fleetgate serve ...` with GatewayConfig.adapter_prewarm_interval_s from $PREWARM_S.

The interval is a GatewayConfig field (default 30 s) that neither the CLI nor the policy file
exposes; this sets it after construction, nothing else changes. Prints which code it imports.
"""

import os
import sys
from pathlib import Path

import adapters_registry.registry as reg
import fleetgate
import gateway.config as gc

orig = gc.GatewayConfig.__post_init__


def post(self):
    orig(self)
    v = os.environ.get("PREWARM_S")
    if v:
        self.adapter_prewarm_interval_s = float(v)


gc.GatewayConfig.__post_init__ = post
# (Not `import adapters_registry.shared_traffic`: the venv's editable-install finder serves a
# module missing from an older PYTHONPATH tree from the installed checkout, so that probe lies.)
shared = "SharedTraffic" in Path(reg.__file__).read_text()
print(
    f"serve_wrap: fleetgate from {fleetgate.__file__}, registry {reg.__file__}, "
    f"shared_traffic={shared}, prewarm_interval_s={os.environ.get('PREWARM_S', 'default')}",
    flush=True,
)
from fleetgate.cli import main  # noqa: E402 -- after the patch above, which it must see

sys.exit(main(sys.argv[1:]))
