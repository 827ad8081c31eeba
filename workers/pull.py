"""The agent's pull runner: downloads the model files the admin pulls onto this host, one at a
time, on a thread of its own (a download never delays a load command or a heartbeat).

A pull is taken from the host's queue onto its taken list (``keys.pull_taken``) and stays
there until it is finished, so an agent that restarts puts it back first in line and resumes
it from its partial file. The bytes go to a hidden temporary name beside the target
(``.NAME.part``), resumed with an HTTP Range request after a dropped connection, checked
against the sha256 the source gave, and renamed only once whole and checked; then the model is
registered from what its GGUF header says. A failed or cancelled pull registers nothing and
leaves no partial file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import requests
import urllib3

from residency import keys, pull_store, registry
from residency.box import Box, ConfigStore, NameTaken
from residency.footprint import read_header
from residency.pull_source import auth_headers
from residency.pulls import PullState, fits, model_facts
from residency.settings import ModelSpec

log = logging.getLogger("residency.pull")

TAKE_WAIT_S = 1
#: How often progress is written (and a cancel looked for) while bytes arrive.
REPORT_EVERY_S = 0.25
CHUNK = 1 << 20
#: Blocks received and not yet written (at most this many x CHUNK bytes in memory).
SINK_DEPTH = 16
#: Connection and between-bytes timeout: a server that stops sending fails the attempt.
READ_TIMEOUT_S = 60.0
#: Attempts per file (each after the first resumes with Range from the partial file).
ATTEMPTS = 5
RETRY_PAUSE_S = 0.5


class PullFailed(Exception):
    """The pull cannot succeed; the message is its record's ``error``."""


class Cancelled(Exception):
    pass


def part_path(final: Path) -> Path:
    return final.with_name(f".{final.name}.part")


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(folder).free


class Sink:
    """Writes the received blocks on one thread and hashes them on another, so the socket is
    read while earlier blocks are written and hashed (all three release the GIL): a download
    runs at the pace of the slowest of the three, not of their sum. Leaving it waits until
    every block put is written and hashed, so the partial file and the digest always agree
    (a resume relies on it)."""

    def __init__(self, f: Any, digest: Any) -> None:
        self.error: BaseException | None = None
        self.lanes = [
            (q, threading.Thread(target=self._drain, args=(q, fn), daemon=True))
            for q, fn in ((self._queue(), f.write), (self._queue(), digest.update))
        ]

    @staticmethod
    def _queue() -> queue.Queue[bytes | None]:
        return queue.Queue(maxsize=SINK_DEPTH)

    def __enter__(self) -> Sink:
        for _, t in self.lanes:
            t.start()
        return self

    def put(self, block: bytes) -> None:
        if self.error is not None:
            raise self.error
        for q, _ in self.lanes:
            q.put(block)

    def _drain(self, q: queue.Queue[bytes | None], fn: Callable[[bytes], Any]) -> None:
        while (block := q.get()) is not None:
            if self.error is not None:
                continue  # keep taking blocks so the reader never blocks on a full queue
            try:
                fn(block)
            except BaseException as e:
                self.error = e

    def __exit__(self, *exc: object) -> None:
        for q, _ in self.lanes:
            q.put(None)
        for _, t in self.lanes:
            t.join()
        if self.error is not None:
            raise self.error


class PullRunner:
    def __init__(self, box: Box, r: redis.Redis, host: str, stop: threading.Event) -> None:
        self.box = box
        self.r = r
        self.host = host
        self.stop = stop
        #: The free-space reading of a folder; a test points it at a small disk.
        self.free_bytes: Callable[[Path], int] = free_bytes
        self.session = requests.Session()

    # -- loop -------------------------------------------------------------------------------

    def run(self) -> None:
        # A pull the previous agent was running goes back to the front of the queue, queued
        # again: it resumes from its partial file.
        while raw := self.r.lmove(
            keys.pull_taken(self.host), keys.pull_queue(self.host), "RIGHT", "LEFT"
        ):
            pull_store.transition(self.r, str(raw), PullState.QUEUED)
        while not self.stop.is_set():
            try:
                self.iteration()
            except redis.RedisError as e:
                log.error("pull runner: %s", e)
                self.stop.wait(1.0)
            except Exception:
                log.exception("pull runner iteration failed")
                self.stop.wait(1.0)

    def iteration(self) -> None:
        raw = self.r.blmove(
            keys.pull_queue(self.host), keys.pull_taken(self.host), TAKE_WAIT_S, "LEFT", "RIGHT"
        )
        if raw is None:
            return
        pull_id = str(raw)
        try:
            self.run_pull(pull_id)
        finally:
            if not self.stop.is_set():
                self.r.lrem(keys.pull_taken(self.host), 1, pull_id)

    def run_pull(self, pull_id: str) -> None:
        rec = pull_store.get(self.r, pull_id)
        if rec is None:
            return
        if rec.get("cancel"):
            pull_store.transition(self.r, pull_id, PullState.CANCELLED, {"error": "cancelled"})
            return
        if not pull_store.transition(self.r, pull_id, PullState.DOWNLOADING):
            return  # cancelled meanwhile, or already finished
        final = Path(rec["dir"]) / rec["file"]
        files: list[Path] = []  # what a failure removes: only files this pull writes
        try:
            spec = self._pull_files(pull_id, rec, final, files)
            if not pull_store.transition(self.r, pull_id, PullState.VERIFYING):
                raise Cancelled
            self._register(pull_id, rec, spec)
        except Cancelled:
            if self.stop.is_set():
                return  # shutting down: stays taken, resumed by the next agent
            self._discard(files)
            pull_store.transition(self.r, pull_id, PullState.CANCELLED, {"error": "cancelled"})
            log.info("pull %s cancelled", pull_id)
        except PullFailed as e:
            self._discard(files)
            pull_store.transition(self.r, pull_id, PullState.FAILED, {"error": str(e)})
            log.error("pull %s failed: %s", pull_id, e)
        except Exception as e:
            self._discard(files)
            pull_store.transition(
                self.r, pull_id, PullState.FAILED, {"error": f"{e.__class__.__name__}: {e}"}
            )
            log.exception("pull %s failed", pull_id)

    # -- the files --------------------------------------------------------------------------

    def _pull_files(
        self, pull_id: str, rec: dict[str, str], final: Path, files: list[Path]
    ) -> dict[str, Any]:
        folder = final.parent
        folder.mkdir(parents=True, exist_ok=True)
        jobs = [(final, rec["url"], rec.get("size"), rec.get("sha256") or None)]
        if rec.get("mmproj_url"):
            proj = folder / rec["mmproj_file"]
            jobs.append((proj, rec["mmproj_url"], rec.get("mmproj_size"), rec.get("mmproj_sha256")))
        for path, _, _, _ in jobs:
            if path.exists():  # another model's file: never replaced, never removed
                raise PullFailed(f"{path} already exists: remove it or pull under another name")
        files += [p for p, *_ in jobs]
        sizes = [int(s) if s else self._probe_size(url) for _, url, s, _ in jobs]
        known = [s for s in sizes if s is not None]
        total = sum(known) if len(known) == len(sizes) else None
        pull_store.report(self.r, pull_id, 0, total)
        self._check_space(folder, jobs, sizes)
        done = 0
        for (path, url, _, sha), size in zip(jobs, sizes, strict=True):
            done = self._download(pull_id, url, path, size, sha, done, total)
        spec: dict[str, Any] = {"path": str(final)}
        if len(jobs) > 1:
            spec["mmproj"] = str(jobs[1][0])
        return spec

    def _probe_size(self, url: str) -> int | None:
        """A plain URL's size (HEAD, redirects followed); None when the server does not say."""
        try:
            resp = self.session.head(
                url, headers=auth_headers(url), allow_redirects=True, timeout=READ_TIMEOUT_S
            )
        except requests.RequestException as e:
            raise PullFailed(f"{url}: {e.__class__.__name__}: {e}") from e
        if resp.status_code >= 400:
            raise PullFailed(f"{url} answered {resp.status_code}")
        length = resp.headers.get("Content-Length")
        return int(length) if length and length.isdigit() else None

    def _check_space(
        self, folder: Path, jobs: list[tuple[Path, str, Any, Any]], sizes: list[int | None]
    ) -> None:
        reserve = ConfigStore(self.box, self.r).load()[0].pulls.disk_reserve_mb << 20
        have = sum(part_path(p).stat().st_size for p, *_ in jobs if part_path(p).exists())
        needed = sum(s or 0 for s in sizes) - have
        free = self.free_bytes(folder)
        if not fits(free, needed, reserve):
            raise PullFailed(
                f"not enough disk space in {folder}: {needed} bytes to write and "
                f"{reserve} to keep free, {free} free"
            )

    def _download(
        self,
        pull_id: str,
        url: str,
        final: Path,
        size: int | None,
        sha256: str | None,
        done_before: int,
        total: int | None,
    ) -> int:
        """Fetch ``url`` into ``final`` (through its partial file); the bytes done after it."""
        part = part_path(final)
        # Resumed bytes are hashed again from the partial file: the checksum covers them too.
        digest = [hashlib.sha256()]
        have = 0
        if part.exists():
            with part.open("rb") as f:
                while block := f.read(CHUNK):
                    digest[0].update(block)
                    have += len(block)
        last_error = ""
        for attempt in range(ATTEMPTS):
            if size is not None and have >= size:
                break
            if attempt and self.stop.wait(RETRY_PAUSE_S):
                raise Cancelled
            try:
                have, complete = self._attempt(
                    pull_id, url, part, have, digest, done_before, total, size
                )
            except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
                last_error = f"{e.__class__.__name__}: {e}"
                log.warning("pull %s: %s (attempt %d); resuming", pull_id, last_error, attempt + 1)
                have = part.stat().st_size if part.exists() else 0
                continue
            if complete:
                break
            last_error = "the connection closed before the whole file came"
        else:
            raise PullFailed(f"{url}: gave up after {ATTEMPTS} attempts: {last_error}")
        if size is not None and have != size:
            raise PullFailed(f"{url}: got {have} bytes, expected {size}")
        pull_store.report(self.r, pull_id, done_before + have, total)
        got = digest[0].hexdigest()
        if sha256 is not None and got != sha256.lower():
            raise PullFailed(f"{final.name}: sha256 {got} does not match the source's {sha256}")
        os.rename(part, final)
        return done_before + have

    def _attempt(
        self,
        pull_id: str,
        url: str,
        part: Path,
        have: int,
        digest: list[Any],
        done_before: int,
        total: int | None,
        size: int | None,
    ) -> tuple[int, bool]:
        """One request from byte ``have``; the bytes held after it and whether it ended with
        the whole file."""
        headers = auth_headers(url)
        if have:
            headers["Range"] = f"bytes={have}-"
        with self.session.get(
            url, headers=headers, stream=True, timeout=(READ_TIMEOUT_S, READ_TIMEOUT_S)
        ) as resp:
            if have and resp.status_code == 200:
                # The server ignored the Range: start over.
                have = 0
                digest[0] = hashlib.sha256()
                part.unlink(missing_ok=True)
            elif resp.status_code == 416 and size is not None and have >= size:
                return have, True
            elif resp.status_code not in (200, 206):
                raise PullFailed(f"{url} answered {resp.status_code}")
            length = resp.headers.get("Content-Length")
            expect = have + int(length) if length and length.isdigit() else size
            if size is not None and expect is not None and expect != size:
                raise PullFailed(f"{url}: the server sends {expect} bytes, expected {size}")
            last = 0.0  # the first bytes are reported at once
            with part.open("ab") as f, Sink(f, digest[0]) as sink:
                # read1: what has arrived, up to CHUNK (progress and a cancel are seen while a
                # slow server trickles, not only once a whole chunk is in).
                while block := resp.raw.read1(CHUNK):
                    sink.put(block)
                    have += len(block)
                    now = time.monotonic()
                    if now - last >= REPORT_EVERY_S:
                        last = now
                        if pull_store.report(self.r, pull_id, done_before + have, total):
                            raise Cancelled
                    if self.stop.is_set():
                        raise Cancelled
        if pull_store.report(self.r, pull_id, done_before + have, total):
            raise Cancelled
        return have, expect is None or have >= expect

    def _discard(self, files: list[Path]) -> None:
        for p in files:
            for q in (part_path(p), p):
                with contextlib.suppress(FileNotFoundError):
                    q.unlink()

    # -- registration -----------------------------------------------------------------------

    def _register(self, pull_id: str, rec: dict[str, str], spec: dict[str, Any]) -> None:
        try:
            facts = model_facts(read_header(spec["path"]))
        except (ValueError, KeyError, OSError) as e:
            raise PullFailed(f"not a usable GGUF file: {e}") from e
        name = rec["name"]
        if registry.get(self.r, name) is not None:
            raise PullFailed(f"a model named '{name}' was registered meanwhile")
        entry = registry.Entry(name, ModelSpec.model_validate({**spec, **facts}), "admin")
        try:
            registry.put(self.r, entry, rec.get("actor") or "admin:-")
        except NameTaken:
            raise PullFailed(f"'{name}' is the name of a policy") from None
        if not pull_store.transition(self.r, pull_id, PullState.DONE, {"error": ""}):
            # Cancelled in the last instant: the cancel wins, the registration is undone.
            registry.delete(self.r, name, rec.get("actor") or "admin:-")
            raise Cancelled
        log.info("pulled %s into %s as %s", rec.get("source"), spec["path"], name)
