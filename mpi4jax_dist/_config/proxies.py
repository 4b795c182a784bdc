"""The proxy variables that would catch the coordinator's traffic, and those that
JAX's proxy check names without being proxy settings (``launch/session.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .env import environ, warn_setting

PROXY = "MPI4JAX_DIST_PROXY"
# Variables that make gRPC send the coordinator's traffic through a proxy, and the
# one that exempts hosts from it (read by gRPC alone, so nothing else changes).
PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")
NO_GRPC_PROXY = "no_grpc_proxy"


def proxies_set(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the names of the proxy variables set (any case): ``["HTTP_PROXY"]``."""
    env = environ() if env is None else env
    wanted = {v.lower() for v in PROXY_VARIABLES}
    return sorted(k for k, v in env.items() if k.lower() in wanted and v.strip())


# Variables that are proxy settings; JAX's proxy check names every variable with
# "_proxy" in its name, so launcher variables such as Intel MPI's
# HYDRA_BSTRAP_PROXY_ID (Hydra's bootstrap proxy, a process) set it off too.
PROXY_SETTINGS = PROXY_VARIABLES + ("all_proxy", "ftp_proxy", "no_proxy", NO_GRPC_PROXY)


def false_proxy_alarms(env: Mapping[str, str] | None = None) -> list[str]:
    """Return the variables JAX's proxy check would name that are not proxy
    settings (any case), when no proxy setting is set; else an empty list."""
    env = environ() if env is None else env
    named = [k for k in env if "_proxy" in k.lower()]
    settings = {v.lower() for v in PROXY_SETTINGS}
    if any(k.lower() in settings for k in named):
        return []
    return sorted(named)


def keep_proxy(env: Mapping[str, str] | None = None) -> bool:
    """Return True when ``MPI4JAX_DIST_PROXY=keep`` asks us not to touch proxies."""
    env = environ() if env is None else env
    value = env.get(PROXY, "").strip().lower()
    if value not in ("", "keep", "exempt"):
        warn_setting(
            f"{PROXY}={env[PROXY]!r}: expected 'keep' (leave proxies alone) or "
            f"'exempt' (the default: add the coordinator to no_grpc_proxy)."
        )
    return value == "keep"


def _exempt_hosts(env: Mapping[str, str]) -> list[str]:
    """The hosts gRPC sends directly: no_grpc_proxy's, else no_proxy's."""
    current = next(
        (
            env[k]
            for k in (NO_GRPC_PROXY, NO_GRPC_PROXY.upper(), "no_proxy", "NO_PROXY")
            if env.get(k)
        ),
        "",
    )
    return [h.strip() for h in current.split(",") if h.strip()]


def caught_by_proxy(host: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Return the proxy variables gRPC would send a connection to ``host``
    through: those set, unless ``host`` is exempt; else an empty list."""
    env = environ() if env is None else env
    return [] if host in _exempt_hosts(env) else proxies_set(env)


def exempt_from_proxy(host: str) -> list[str] | None:
    """Add ``host`` to ``no_grpc_proxy`` when a proxy variable would catch it.

    Returns the proxy variables that made it necessary, or None when nothing changed
    (no proxy set, ``MPI4JAX_DIST_PROXY=keep``, or ``host`` already exempt).
    """
    env = os.environ
    found = caught_by_proxy(host, env)
    if not found or keep_proxy(env):
        return None
    # gRPC reads no_grpc_proxy, else no_proxy: start from what it would have used,
    # so that the user's own exemptions still hold for every gRPC channel.
    env[NO_GRPC_PROXY] = ",".join(_exempt_hosts(env) + [host])
    return found
