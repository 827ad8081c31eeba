"""A worker host's id: ``RESIDENCY_HOST``, or the machine's host name when it is unset.

The id names the host's keys (``keys.worker``, ``keys.agent_commands``…) and its place in
``/health``, so it must be one token: letters, digits, ``.``, ``_`` and ``-`` (no ``:``, the
key separator, and no whitespace), at most ``MAX_LEN`` characters. An agent that restarts with
the same id takes its host's record back; two agents with one id would take each other's load
commands, so each host needs its own."""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping

from residency.settings import SettingsError

ENV = "RESIDENCY_HOST"
MAX_LEN = 128
HOST_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LEN - 1}}}")


def host_id(environ: Mapping[str, str], hostname: str | None = None) -> str:
    """The validated host id: ``RESIDENCY_HOST`` if set (even to the empty string, which is
    refused rather than silently replaced), else ``hostname`` (default: this machine's).
    Raises SettingsError naming RESIDENCY_HOST."""
    if ENV in environ:
        return check(environ[ENV])
    name = hostname if hostname is not None else socket.gethostname()
    try:
        return check(name)
    except SettingsError as e:
        raise SettingsError(
            {ENV: f"unset, and the host name {name!r} is no valid host id ({e.problems[ENV]})"}
        ) from None


def check(host: str) -> str:
    """``host`` if it is a valid host id, else SettingsError naming RESIDENCY_HOST."""
    if HOST_RE.fullmatch(host):
        return host
    if not host:
        why = "must not be empty"
    elif len(host) > MAX_LEN:
        why = f"at most {MAX_LEN} characters, got {len(host)}"
    else:
        why = "letters, digits, '.', '_' and '-' only, starting with a letter or digit"
    raise SettingsError({ENV: f"{why}; got {host[: MAX_LEN + 8]!r}"})
