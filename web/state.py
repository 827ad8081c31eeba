"""Per-process state of a web worker: Redis clients, scripts and the cached effective settings.

Nothing here touches Redis before the first request: gunicorn forks its workers after the app
module is imported, and a socket opened before the fork would be shared by every worker.
Settings are cached and reloaded only when the *config* generation moved (an admin change) or
the config file changed on disk, so a request costs one pipelined round trip (config generation
+ registry entry), not a settings read, and the coordinator's passes (which move the pass
generation twice a second) cost nothing here. A reload that fails (a typo in the file) keeps
the last good settings: the box keeps serving, and ``/health`` names the problem.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import redis
from flask import current_app

from residency import keys
from residency.box import Box, ConfigStore, probe
from residency.errors import ApiError
from residency.lua import Scripts
from residency.policy_store import PolicyEntry
from residency.registry import Entry
from residency.settings import Settings

log = logging.getLogger(__name__)

EXTENSION = "residency"
#: Socket timeouts of the readiness probe's client: an unreachable Redis makes /readyz fail at
#: once instead of after the request client's 30 s.
PROBE_TIMEOUT_S = 1.0

#: (mtime_ns, size, inode) of the config file, or None when there is none (or it is missing).
FileStamp = tuple[int, int, int] | None


@dataclass(frozen=True)
class View:
    """Effective settings as of one config generation and config file version."""

    settings: Settings
    sources: dict[str, str]
    config_generation: int
    file_stamp: FileStamp


ENTRY_CACHE_SIZE = 1024


class State:
    def __init__(self, box: Box) -> None:
        self.box = box
        self._lock = threading.Lock()
        self._r: redis.Redis | None = None
        self._probe: redis.Redis | None = None
        self._scripts: Scripts | None = None
        self._view: View | None = None
        # The config version the last reload attempt was for, and why it failed (None: it did
        # not): a failed version is not read again on every request, only when it changes.
        self._tried: tuple[int, FileStamp] | None = None
        self._error: str | None = None
        self._admin_key: str | None = None
        # Registry entries parsed and validated, by their stored text: a request for a model
        # costs a dictionary lookup instead of a validation, and a changed entry has new text.
        self._entries: dict[tuple[str, str], Entry] = {}
        #: Settings reads so far (successful or not): what a test counts to show that the
        #: coordinator's passes cause none.
        self.reloads = 0

    # --- lazily created clients (after fork) -------------------------------------------------

    @property
    def r(self) -> redis.Redis:
        if self._r is None:
            with self._lock:
                if self._r is None:
                    # A waiting request holds a connection (its XREAD): as many as the worker
                    # holds connections, and some for the rest.
                    srv = self.box.base_settings().server
                    self._r = self.box.redis(max_connections=srv.web_connections + 64)
        return self._r

    @property
    def probe(self) -> redis.Redis:
        """A client with short timeouts and no retries, for /readyz."""
        if self._probe is None:
            with self._lock:
                if self._probe is None:
                    if not self.box.redis_url:
                        raise RuntimeError("no Redis URL")
                    self._probe = probe(self.box.redis_url, PROBE_TIMEOUT_S)
        return self._probe

    @property
    def scripts(self) -> Scripts:
        if self._scripts is None:
            with self._lock:
                if self._scripts is None:
                    self._scripts = Scripts(self.r)
        return self._scripts

    # --- settings ----------------------------------------------------------------------------

    def _file_stamp(self) -> FileStamp:
        p = self.box.config_path
        if p is None:
            return None
        try:
            st = os.stat(p)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _reload(self, config_generation: int, stamp: FileStamp) -> View:
        # The config generation is read before the settings: if a change lands in between, the
        # cache holds newer settings under an older number and simply reloads once more.
        with self._lock:
            self.reloads += 1
            self._tried = (config_generation, stamp)
        try:
            s, sources = ConfigStore(self.box, self.r).load()
        except ValueError as e:  # SettingsError, or an admin value that is not JSON
            return self._keep_last_good(str(e))
        view = View(s, sources, config_generation, stamp)
        with self._lock:
            if self._error is not None:
                log.info("settings are valid again; using them")
            self._error = None
            if self._view is None or self._view.config_generation <= config_generation:
                self._view = view
        return view

    def _keep_last_good(self, message: str) -> View:
        with self._lock:
            first = message != self._error
            self._error = message
            view = self._view
        if first:  # once per distinct problem, not once per request
            log.error("%s; keeping the last good settings", message)
        if view is None:
            # Never had good settings (the process validates them at start, so the file broke
            # before its first request): nothing to keep serving with.
            raise ApiError(
                503,
                f"the box's settings are invalid: {message}",
                type="server_error",
                code="invalid_config",
                retry_after=5,
            )
        return view

    def _current(self, config_generation: int) -> View:
        stamp = self._file_stamp()
        v = self._view
        if v is not None and (v.config_generation, v.file_stamp) == (config_generation, stamp):
            return v
        if self._tried == (config_generation, stamp) and self._error is not None:
            return self._keep_last_good(self._error)
        return self._reload(config_generation, stamp)

    def cached(self) -> View:
        """Settings without a Redis round trip once loaded (for the body size limit, which is
        needed before the request's model, and so its round trip, is known)."""
        return self._view or self.refresh()

    def refresh(self) -> View:
        """One GET of the config generation; reloads the settings only if it (or the config
        file) changed."""
        return self._current(int(self.r.get(keys.config_generation()) or 0))

    def config_error(self) -> str | None:
        """Why the last settings reload failed (the last good settings are in use), or None."""
        return self._error

    def lookup(self, model: str) -> tuple[View, Entry | None, PolicyEntry | None]:
        """Settings, and the name's registry entry or policy, in one pipelined round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(keys.config_generation())
        pipe.hget(keys.registry(), model)
        pipe.hget(keys.policies(), model)
        gen, raw, raw_policy = pipe.execute()
        view = self._current(int(gen or 0))
        entry = self._entry(model, raw) if raw else None
        return view, entry, PolicyEntry.loads(model, raw_policy) if raw_policy else None

    def entries(self, names: list[str]) -> dict[str, Entry]:
        """The registry entries of ``names`` that are registered, in one round trip (parsed
        through the same cache as ``lookup``'s)."""
        raws = self.r.hmget(keys.registry(), names) if names else []
        return {n: self._entry(n, str(raw)) for n, raw in zip(names, raws, strict=True) if raw}

    def _entry(self, model: str, raw: str) -> Entry:
        entry = self._entries.get((model, raw))
        if entry is None:
            if len(self._entries) >= ENTRY_CACHE_SIZE:
                self._entries.clear()  # names come from clients: the cache stays bounded
            entry = self._entries[(model, raw)] = Entry.loads(model, raw)
        return entry

    # --- admin key ---------------------------------------------------------------------------

    def admin_key(self) -> str | None:
        if self._admin_key is None:
            try:
                self._admin_key = self.box.admin_key()
            except RuntimeError:
                return None  # not created yet: look again on the next call
        return self._admin_key


def state() -> State:
    """The State of the app serving the current request."""
    st = current_app.extensions[EXTENSION]
    assert isinstance(st, State)
    return st
