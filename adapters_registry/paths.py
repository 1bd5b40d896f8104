"""Adapter source paths: normalisation and confinement to per-tenant storage roots.

A source is either a local path on the replicas' disk (absolute, or ``file:///abs``) or a URI the
engine resolves itself (``s3://``, ``hf://``, …), which is passed through unchanged. Local paths
are normalised (``//`` and ``.`` dropped) but a ``..`` component is refused rather than resolved:
resolving it is exactly how a path escapes into another tenant's directory.

The gateway cannot resolve symlinks (the files live on the replicas), so storage roots must not
contain symlinks that lead out of them; that is a deployment rule, documented in docs/adapters.md.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from routing.config.tenancy import SOURCE_WITH_CREDENTIALS

#: Schemes the engine resolves itself; their sources are passed through as written.
REMOTE_SCHEMES = ("s3", "gs", "hf", "http", "https")


def normalise_source(source: str) -> str:
    """The canonical form of an adapter source; raises ``ValueError`` naming the problem.

    Absolute paths and ``file://`` URIs become a normalised absolute path; remote URIs are
    returned unchanged (after checking they have no ``..`` component).
    """
    if not source or source != source.strip():
        raise ValueError(
            f"must be a non-empty path or URI without surrounding spaces (got {source!r})"
        )
    if "\x00" in source:
        raise ValueError("must not contain NUL characters")
    if source.startswith("/"):
        return _normalise_local(source, source)
    parts = urlsplit(source)
    if "@" in parts.netloc:
        raise ValueError(SOURCE_WITH_CREDENTIALS)
    if parts.scheme == "file":
        if parts.netloc:
            raise ValueError(f"file:// URIs take no host: use file:///abs/path (got {source!r})")
        return _normalise_local(parts.path, source)
    if parts.scheme in REMOTE_SCHEMES:
        if not parts.netloc:
            raise ValueError(f"must name a bucket, repository or host after '://' (got {source!r})")
        if ".." in parts.path.split("/"):
            raise ValueError(f"must not contain '..' (got {source!r})")
        return source
    raise ValueError(
        f"must be an absolute path or a URI with scheme file, {', '.join(REMOTE_SCHEMES)} "
        f"(got {source!r})"
    )


def _normalise_local(path: str, original: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"must be an absolute path (got {original!r})")
    if ".." in path.split("/"):
        raise ValueError(f"must not contain '..' (got {original!r})")
    normalised = posixpath.normpath(path)
    # POSIX keeps a leading '//' as implementation-defined; collapse it like any other '//'.
    return "/" + normalised.lstrip("/")


def is_local(source: str) -> bool:
    """True if a normalised source is a path on the replicas' disk."""
    return source.startswith("/")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


@dataclass(frozen=True)
class StorageRoots:
    """Where each tenant's adapters may live on the replicas' disk.

    ``by_tenant`` maps a tenant to its allowed roots; ``shared`` applies to adapters without
    owners (public ones) and to owners with no entry of their own. A local source must lie under
    an allowed root of *every* owner, so an adapter shared by two tenants cannot point into
    either one's private directory unless both are allowed there. Once any root is configured,
    an owner left with none (no entry and no shared roots) may point nowhere: it would otherwise
    reach every other tenant's directory. With no roots configured at all, any absolute path is
    accepted (single-tenant deployments).
    """

    by_tenant: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    shared: tuple[str, ...] = ()

    @classmethod
    def build(
        cls, by_tenant: Mapping[str, Iterable[str]] | None = None, shared: Sequence[str] = ()
    ) -> StorageRoots:
        """Normalise and check every root (absolute, no ``..``)."""
        tenants = {
            tenant: tuple(_normalise_local(root, root) for root in roots)
            for tenant, roots in (by_tenant or {}).items()
        }
        return cls(tenants, tuple(_normalise_local(root, root) for root in shared))

    @property
    def configured(self) -> bool:
        """True if any root is configured."""
        return bool(self.shared) or any(self.by_tenant.values())

    def roots_for(self, owner: str | None) -> tuple[str, ...]:
        """Allowed roots of ``owner`` (None: an adapter without owners)."""
        if owner is None:
            return self.shared
        return self.by_tenant.get(owner, self.shared)

    def check(self, source: str, owners: Sequence[str]) -> None:
        """Raise ``ValueError`` if a normalised local ``source`` escapes its owners' roots."""
        if not is_local(source) or not self.configured:
            return
        for owner in owners or [None]:
            roots = self.roots_for(owner)
            who = f"tenant {owner!r}" if owner is not None else "adapters without owners"
            if not roots:
                raise ValueError(
                    f"no storage roots allow local paths for {who}: give it storage roots "
                    "(or shared ones) to load adapters from disk"
                )
            if not any(_within(source, root) for root in roots):
                raise ValueError(
                    f"{source!r} is outside the storage roots of {who} ({', '.join(roots)})"
                )


def engine_path(source: str) -> str:
    """The ``lora_path`` to hand vLLM: a plain path for local sources, else the URI unchanged."""
    return normalise_source(source)
