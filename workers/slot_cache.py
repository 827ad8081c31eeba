"""A model process's saved slot caches: which entries its load may restore, which one a prompt
should start from, and the save at its drain (files in ``workers.kvstore``; no Redis here: the
model process publishes what ``counts`` returns).

Entries are indexed once, at load: every file of the model's folder is checked (head digest,
size, spec digest, clear epochs) and the ones that fail are deleted and counted, so a corrupt,
truncated or stale entry is never offered. A prompt is offered the entry whose tokens it may
reuse most of (``[cache] scope`` applies to saved entries as to live slots), read and checked
against its state digest before the request is submitted: the engine thread only copies the
bytes into llama.cpp.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from residency.registry import kv_layout
from residency.settings import ModelSpec
from workers import kvstore
from workers.engine import Restore, SlotImage
from workers.kvstore import Corrupt, Entry, Stale, Stamp
from workers.slots import MIN_GAIN, Asker, allowed

log = logging.getLogger("residency.kvcache")

#: A slot holding fewer tokens is not saved: no restore of it could gain MIN_GAIN tokens.
MIN_SAVE_TOKENS = MIN_GAIN


def _stamp(path: str) -> list[object]:
    try:
        st = os.stat(path)
        return [os.path.realpath(path), st.st_size, st.st_mtime_ns]
    except OSError:
        return [path, None, None]


def spec_digest(spec: ModelSpec, parallel: int, state_format: str) -> str:
    """What a saved state depends on: the spec's KV layout (``registry.kv_layout`` with the
    ``parallel`` loaded: a state holds each slot's stream, another ``parallel`` cannot read it),
    the model file and its vision projector as they are on disk (real path, size, modification
    time: a saved image's KV was made by that projector) and the library that wrote it.
    Anything else may change without losing the cache."""
    data: dict[str, object] = {
        "layout": list(kv_layout(spec, parallel)),
        "file": _stamp(spec.path or ""),
        "format": [kvstore.FORMAT, state_format],
    }
    if spec.mmproj is not None:
        data["mmproj"] = _stamp(spec.mmproj)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]


@dataclass
class Counts:
    """What happened since the last ``SlotCache.take_counts`` (for metrics)."""

    saves: int = 0
    saved_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # saves skipped, by reason
    restores: int = 0
    restored_tokens: int = 0
    restore_seconds: list[float] = field(default_factory=list)
    bad: dict[str, int] = field(default_factory=dict)  # entries deleted: corrupt, stale

    def any(self) -> bool:
        return bool(self.saves or self.skipped or self.restores or self.bad)


@dataclass(frozen=True)
class SaveReport:
    saved: int
    bytes: int
    skipped: dict[str, int]


class SlotCache:
    """The saved entries of one model spec on this host (``root``/``model``)."""

    def __init__(
        self, root: Path, model: str, stamp: Stamp, fresh: Callable[[], bool] = lambda: True
    ) -> None:
        self.root = root
        # Asked before a restore: False once a clear made this load's stamp stale (the agent
        # deletes the files at its next heartbeat; none is restored meanwhile).
        self.fresh = fresh
        self.model = model
        self.folder = kvstore.model_dir(root, model)
        self.stamp = stamp
        self._entries: list[Entry] = []
        self._lock = threading.Lock()
        self._counts = Counts()
        # The model's sliding window (0: none; set when attached to a runtime). A saved state
        # holds only the window's last positions of its SWA layers: it serves a prompt that
        # goes on from its whole length, no shorter prefix of it (``Engine._trim``).
        self.n_swa = 0

    # -- index ------------------------------------------------------------------------------

    def scan(self) -> None:
        """Index the model's entries; delete (and count) what does not check out, and the
        temporary files of writers that died."""
        kvstore.sweep_tmp(self.folder)
        found: list[Entry] = []
        try:
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.endswith(kvstore.SUFFIX):
                continue
            path = self.folder / name
            try:
                found.append(kvstore.read_entry(path, self.stamp))
            except FileNotFoundError:
                continue
            except (Corrupt, Stale) as e:
                self._drop(path, e)
            except OSError as e:
                log.warning("%s: slot cache entry %s unreadable: %s", self.model, name, e)
        with self._lock:
            self._entries = found

    def _drop(self, path: Path, why: Exception) -> None:
        reason = "stale" if isinstance(why, Stale) else "corrupt"
        log.warning("%s: slot cache entry %s deleted (%s: %s)", self.model, path.name, reason, why)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with self._lock:
            self._entries = [e for e in self._entries if e.path != path]
            self._counts.bad[reason] = self._counts.bad.get(reason, 0) + 1

    def usage(self) -> tuple[int, int]:
        """(entries, bytes) indexed for this model."""
        with self._lock:
            return len(self._entries), sum(e.size for e in self._entries)

    # -- restore ----------------------------------------------------------------------------

    def best(self, prompt: Sequence[int], asker: Asker) -> tuple[Entry, int] | None:
        """The entry whose tokens ``asker`` may reuse most of, with that count."""
        arr = np.asarray(prompt, dtype=np.int32)
        cap = max(len(prompt) - 1, 0)
        with self._lock:
            entries = list(self._entries)
        top: tuple[Entry, int] | None = None
        for e in entries:
            n = min(allowed(kvstore.common_prefix(e.tokens, arr), e.owner, e.shareable, asker), cap)
            if self.n_swa and len(e.tokens) > self.n_swa and n < len(e.tokens):
                continue  # its window's start is gone: no prefix of it can be restored
            if n > 0 and (top is None or n > top[1]):
                top = (e, n)
        return top

    def offer(self, prompt: Sequence[int], asker: Asker, held: int) -> Restore | None:
        """The saved state a prompt should start from, read and checked, when it reuses at
        least MIN_GAIN more tokens than ``held`` (what a live slot already offers it); None
        otherwise. A corrupt entry is deleted and counted, never offered."""
        top = self.best(prompt, asker)
        if top is None or top[1] < held + MIN_GAIN:
            return None
        if not self.fresh():
            with self._lock:
                self._entries = []
            return None
        entry = top[0]
        t0 = time.perf_counter()
        try:
            data = kvstore.read_state(entry)
        except FileNotFoundError:  # deleted meanwhile (a budget, a clear)
            with self._lock:
                self._entries = [e for e in self._entries if e.path != entry.path]
            return None
        except (Corrupt, OSError) as e:
            self._drop(entry.path, e if isinstance(e, Corrupt) else Corrupt(str(e)))
            return None
        read_s = time.perf_counter() - t0
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # recently used: the budget deletes it last
        return Restore(
            tokens=[int(t) for t in entry.tokens],
            owner=entry.owner,
            shareable=entry.shareable,
            data=data,
            done=self._done(entry, read_s),
        )

    def _done(self, entry: Entry, read_s: float) -> Callable[[str, int, float], None]:
        def done(outcome: str, tokens: int, seconds: float) -> None:
            if outcome == "refused":  # what the digests accepted, llama.cpp did not
                self._drop(entry.path, Corrupt("llama.cpp refused the state"))
            if outcome != "restored":
                return
            with self._lock:
                self._counts.restores += 1
                self._counts.restored_tokens += tokens
                self._counts.restore_seconds.append(read_s + seconds)

        return done

    # -- save -------------------------------------------------------------------------------

    def save(
        self,
        images: Sequence[SlotImage],
        budget_bytes: int,
        deadline: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> SaveReport:
        """Write each slot image as an entry, within ``budget_bytes`` for the host's whole
        folder (least recently used entries out) and the disk's own room, until ``deadline``
        (``clock``'s). An entry of the same user whose tokens a new one extends is replaced by
        it. A save that does not fit is skipped, never an error."""
        saved = total = 0
        skipped: dict[str, int] = {}

        def skip(reason: str) -> None:
            skipped[reason] = skipped.get(reason, 0) + 1

        if images and not self.fresh():
            # Cleared since the load: what the slots hold is what the clear meant to drop.
            images = []
            skip("cleared")
        for img in images:
            if len(img.tokens) < MIN_SAVE_TOKENS:
                continue
            if clock() >= deadline:
                skip("timeout")
                continue
            tokens = np.asarray(img.tokens, dtype=np.int32)
            name = kvstore.entry_name(img.owner, tokens)
            state = img.data
            head, state_sum = kvstore.encode(self.stamp, img.owner, img.shareable, tokens, state)
            size = len(head) + len(state)
            older = self._superseded(img.owner, tokens, self.folder / name)
            # What this entry replaces is deleted once it is written: counted as room now.
            freed = sum(_size(p) for p in [*older, self.folder / name])
            if size > budget_bytes or not kvstore.make_room(
                self.root, max(0, size - freed), budget_bytes, keep=frozenset(older)
            ):
                skip("budget")
                continue
            if not kvstore.disk_has_room(self.root, size):
                skip("disk_full")
                continue
            try:
                path = kvstore.write_entry(
                    self.folder, name, head, state, abandon=lambda: clock() >= deadline
                )
            except TimeoutError:
                skip("timeout")
                continue
            except OSError as e:
                log.warning("%s: slot cache save failed: %s", self.model, e)
                skip("error")
                continue
            for p in older:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            saved += 1
            total += size
            entry = Entry(path, tokens, img.owner, img.shareable, len(state), state_sum, size)
            with self._lock:
                self._entries = [e for e in self._entries if e.path != path and e.path not in older]
                self._entries.append(entry)
        with self._lock:
            self._counts.saves += saved
            self._counts.saved_bytes += total
            for k, v in skipped.items():
                self._counts.skipped[k] = self._counts.skipped.get(k, 0) + v
        return SaveReport(saved, total, skipped)

    def _superseded(self, owner: str, tokens: np.ndarray, path: Path) -> list[Path]:
        """Entries of ``owner`` whose tokens ``tokens`` begins with (the conversation went
        on): the new entry replaces them."""
        with self._lock:
            entries = list(self._entries)
        return [
            e.path
            for e in entries
            if e.path != path
            and e.owner == owner
            and len(e.tokens) <= len(tokens)
            and kvstore.common_prefix(e.tokens, tokens) == len(e.tokens)
        ]

    def take_counts(self) -> Counts:
        with self._lock:
            out, self._counts = self._counts, Counts()
        return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
