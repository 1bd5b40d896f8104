"""The routing profiles of a policy file, for the simulator to replay by name.

``fleetgate serve --config policy.yaml`` routes with the file's own ``profiles:`` (plugins with
their parameters and weights). Rehearsing that policy in the simulator means building the same
profiles from the same file, fresh for each replay (plugins learn: calibrations, recent duty
cycles). A factory is a ``functools.partial`` of a module-level function over the file's path,
so it crosses into ``--jobs`` worker processes, which read the file themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from routing.engine import Profile


class PolicyFileError(ValueError):
    """The file cannot be read or is not a valid policy: every problem, one per line."""


def policy_file_profiles(path: str) -> tuple[str, ...]:
    """The names of the profiles ``path`` defines (built-in ones it leaves as they are)."""
    from routing.config import PolicyError, load_policy

    try:
        policy = load_policy(path)
    except PolicyError as exc:
        raise PolicyFileError(
            f"{path} is invalid:\n" + "\n".join(f"  {error}" for error in exc.errors)
        ) from None
    return tuple(profile.name for profile in policy.profiles)


def file_profile_factories(
    path: str, names: Iterable[str]
) -> Mapping[str, Callable[[], Profile]]:
    """A factory per name in ``names`` (profiles ``path`` defines, as ``policy_file_profiles``
    listed them): each call builds the profile afresh from the file."""
    return {name: partial(build_file_profile, path, name) for name in names}


def build_file_profile(path: str, name: str) -> Profile:
    """Profile ``name`` of the policy file at ``path``, with fresh plugin instances."""
    from routing.config import load_policy

    profile: Profile = load_policy(path).profiles_for_engine()[name]
    return profile
