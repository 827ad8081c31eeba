"""Per-process state of a web worker: Redis client, scripts and the cached effective settings.

Nothing here touches Redis before the first request: gunicorn forks its workers after the app
module is imported, and a socket opened before the fork would be shared by every worker.
Settings are cached and reloaded only when the generation counter moved, so a request costs one
pipelined round trip (generation + registry entry), not a full settings read.
"""

from __future__ import annotations

import hmac
import threading
from dataclasses import dataclass

import redis
from flask import current_app

from residency import keys
from residency.box import Box, ConfigStore
from residency.lua import Scripts
from residency.policy_store import PolicyEntry
from residency.registry import Entry
from residency.settings import Settings

EXTENSION = "residency"


@dataclass(frozen=True)
class View:
    """Effective settings as of one generation."""

    settings: Settings
    sources: dict[str, str]
    generation: int


class State:
    def __init__(self, box: Box) -> None:
        self.box = box
        self._lock = threading.Lock()
        self._r: redis.Redis | None = None
        self._scripts: Scripts | None = None
        self._view: View | None = None
        self._admin_key: str | None = None

    # --- lazily created clients (after fork) -------------------------------------------------

    @property
    def r(self) -> redis.Redis:
        if self._r is None:
            with self._lock:
                if self._r is None:
                    self._r = self.box.redis()
        return self._r

    @property
    def scripts(self) -> Scripts:
        if self._scripts is None:
            with self._lock:
                if self._scripts is None:
                    self._scripts = Scripts(self.r)
        return self._scripts

    # --- settings ----------------------------------------------------------------------------

    def _reload(self, generation: int) -> View:
        # The generation is read before the settings: if a change lands in between, the cache
        # holds newer settings under an older generation and simply reloads once more.
        s, sources = ConfigStore(self.box, self.r).load()
        view = View(s, sources, generation)
        with self._lock:
            if self._view is None or self._view.generation <= generation:
                self._view = view
        return view

    def at(self, generation: int) -> View:
        """The view for ``generation`` (after this process changed the settings itself)."""
        v = self._view
        if v is not None and v.generation == generation:
            return v
        return self._reload(generation)

    def cached(self) -> View:
        """Settings without a Redis round trip once loaded (for the body size limit, which is
        needed before the request's model, and so its round trip, is known)."""
        return self._view or self.refresh()

    def refresh(self) -> View:
        """One GET of the generation; reloads the settings only if it moved."""
        return self.at(int(self.r.get(keys.generation()) or 0))

    def lookup(self, model: str) -> tuple[View, Entry | None, PolicyEntry | None]:
        """Settings, and the name's registry entry or policy, in one pipelined round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(keys.generation())
        pipe.hget(keys.registry(), model)
        pipe.hget(keys.policies(), model)
        gen, raw, raw_policy = pipe.execute()
        view = self.at(int(gen or 0))
        entry = Entry.loads(model, raw) if raw else None
        return view, entry, PolicyEntry.loads(model, raw_policy) if raw_policy else None

    # --- admin key ---------------------------------------------------------------------------

    def admin_key(self) -> str | None:
        if self._admin_key is None:
            try:
                self._admin_key = self.box.admin_key()
            except RuntimeError:
                return None  # not created yet: look again on the next call
        return self._admin_key

    def is_admin(self, authorization: str | None) -> bool:
        key = self.admin_key()
        if not key or not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), key.encode())


def state() -> State:
    """The State of the app serving the current request."""
    st = current_app.extensions[EXTENSION]
    assert isinstance(st, State)
    return st
