"""``${NAME}`` references in Redis URLs: a password from the environment, read when connecting.

A policy file is a ConfigMap, shown by ``/admin/policy`` and in logs; a password written there is a
leak. ``redis://:${REDIS_PASSWORD}@redis:6379/0`` keeps only the reference there, and the process
that connects reads the value from its own environment (a Kubernetes Secret).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

__all__ = ["ENV_REFERENCE", "SECRET_OPTION", "expand_env"]

#: A Redis URL's query options that carry a secret (a password, the Sentinels', a client key's
#: passphrase): group 1 the ``name=``, group 2 the value.
SECRET_OPTION = re.compile(r"(?<=[?&])((?:sentinel_|ssl_)?password=)([^&#\s]*)")

#: ``${NAME}`` in a Redis URL: the value of that environment variable, read when connecting.
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(url: str, env: Mapping[str, str] | None = None) -> str:
    """``url`` with every ``${NAME}`` replaced by that environment variable (of ``env``,
    default ``os.environ``), percent-encoded (a generated password holds ``/``, ``+``, ``=``,
    which would break the URL), so a password can come from a Secret while the policy file (a
    ConfigMap, logs, ``/admin/policy``) shows only the reference. ``ValueError`` naming the
    variable if one is not set."""
    from urllib.parse import quote

    environ = os.environ if env is None else env

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise ValueError(
                f"the Redis URL names ${{{name}}}, which is not set in this process's "
                "environment (set it, e.g. from a Kubernetes Secret)"
            )
        return quote(environ[name], safe="")

    return ENV_REFERENCE.sub(value, url)
