"""Slot caches on a host's disk: one file per saved slot, the format and the folder.

When a model drains, each of its slots' KV state is written here with the tokens it holds, whose
request filled it, and the digest of the spec it was computed under; a later load of the same
spec restores a state into a slot instead of prefilling its tokens again.

A file is ``MAGIC | head digest | head length | head (JSON) | tokens (int32) | state``. The
head digest covers the head and the tokens, so a scan reads only those to index an entry (the
state can be hundreds of MB); the head holds the state's own digest, checked when the state is
read for a restore. A file is written to a temporary name, synced and renamed, so a crash
mid-write leaves a temporary file (removed at a later scan) and never an entry that loads.
Anything that does not check out — a flipped byte, a truncated file, another spec, an entry a
clear made stale — is deleted when it is seen and never handed to llama.cpp.

The folder holds one sub-folder per model, shared by every model process of the host; its size
is bounded by ``[cache] disk_mb``, least recently used (file mtime, touched at each restore)
out first. Files only: no Redis here (``workers.slot_cache`` joins this to the process).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("residency.kvcache")

MAGIC = b"RSDKVC1\n"
FORMAT = 1
SUFFIX = ".kvc"
TMP_MARK = ".tmp."
_LEN = struct.Struct("<I")
_DIGEST = 32
#: Free disk a save leaves beside its file, whatever the budget says: a cache never fills the
#: disk the box's Redis and logs write to.
DISK_RESERVE_BYTES = 256 << 20
#: A temporary file older than this is a crashed writer's (a live one renames within
#: ``save_timeout_s``, far less).
STALE_TMP_S = 600.0
#: The longest head a scan reads: a file claiming more is not ours.
MAX_HEAD = 1 << 16


class Corrupt(ValueError):
    """An entry that does not check out (truncated, flipped, or not this format)."""


class Stale(ValueError):
    """An entry of another spec, or from before a clear: never restored, deleted."""


@dataclass(frozen=True)
class Stamp:
    """What an entry must match to be used: the spec digest of the load, and the clear epochs
    (of every model, and of this one) current when it was saved."""

    spec: str
    epoch_all: int = 0
    epoch_model: int = 0


@dataclass(frozen=True)
class Entry:
    """A saved slot as indexed by a scan (its state stays on disk until a restore reads it)."""

    path: Path
    tokens: np.ndarray  # int32
    owner: str
    shareable: int
    state_len: int
    state_sum: str
    size: int  # the file's bytes


def model_dir(root: Path, model: str) -> Path:
    # Model names are validated (no separator, no leading dot): safe as a folder name.
    return root / model


def owner_tag(owner: str) -> str:
    """What an entry's file name says of its owner (a digest: no user name on disk names)."""
    return hashlib.sha256(b"owner\0" + owner.encode("utf-8")).hexdigest()[:12]


def entry_name(owner: str, tokens: np.ndarray) -> str:
    """One file per (owner, tokens): the same slot saved again replaces its entry. The name
    starts with the owner's tag, so the budget can share the disk between owners without
    reading a file."""
    h = hashlib.sha256(owner.encode("utf-8") + b"\0" + tokens.astype("<i4").tobytes())
    return f"{owner_tag(owner)}-{h.hexdigest()[:40]}{SUFFIX}"


def encode(
    stamp: Stamp, owner: str, shareable: int, tokens: np.ndarray, state: bytes
) -> tuple[bytes, str]:
    """The file's bytes before the state (the state is written after them, not copied), and
    the state's digest that they hold."""
    toks = tokens.astype("<i4").tobytes()
    state_sum = hashlib.sha256(state).hexdigest()
    head = json.dumps(
        {
            "format": FORMAT,
            "spec": stamp.spec,
            "epoch_all": stamp.epoch_all,
            "epoch_model": stamp.epoch_model,
            "owner": owner,
            "shareable": shareable,
            "n_tokens": len(tokens),
            "state_len": len(state),
            "state_sum": state_sum,
            "saved": int(time.time()),
        },
        separators=(",", ":"),
    ).encode("utf-8")
    body = _LEN.pack(len(head)) + head + toks
    return MAGIC + hashlib.sha256(body).digest() + body, state_sum


def read_entry(path: Path, stamp: Stamp) -> Entry:
    """Index one file: its head and tokens checked against their digest, its size against the
    head, its stamp against ``stamp``. Raises ``Corrupt`` (or ``Stale``) otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        pre = fh.read(len(MAGIC) + _DIGEST + _LEN.size)
        if len(pre) < len(MAGIC) + _DIGEST + _LEN.size or not pre.startswith(MAGIC):
            raise Corrupt("not a slot cache file")
        digest = pre[len(MAGIC) : len(MAGIC) + _DIGEST]
        (n_head,) = _LEN.unpack(pre[-_LEN.size :])
        if n_head > MAX_HEAD:
            raise Corrupt("head too long")
        head_raw = fh.read(n_head)
        try:
            head = json.loads(head_raw)
            n_tokens, state_len = int(head["n_tokens"]), int(head["state_len"])
        except (ValueError, KeyError, TypeError) as e:
            raise Corrupt(f"unreadable head: {e}") from None
        if n_tokens < 1 or n_tokens > 1 << 24 or state_len < 0:
            raise Corrupt("impossible sizes")
        toks = fh.read(4 * n_tokens)
    if hashlib.sha256(pre[-_LEN.size :] + head_raw + toks).digest() != digest:
        raise Corrupt("head digest mismatch")
    expected = len(pre) + n_head + 4 * n_tokens + state_len
    if size != expected:
        raise Corrupt(f"{size} bytes where the head says {expected}")
    if head.get("format") != FORMAT or head.get("spec") != stamp.spec:
        raise Stale("saved under another spec")
    if head.get("epoch_all") != stamp.epoch_all or head.get("epoch_model") != stamp.epoch_model:
        raise Stale("cleared since it was saved")
    return Entry(
        path=path,
        tokens=np.frombuffer(toks, dtype="<i4").astype(np.int32),
        owner=str(head.get("owner", "")),
        shareable=int(head.get("shareable", 0)),
        state_len=state_len,
        state_sum=str(head.get("state_sum", "")),
        size=size,
    )


def read_state(entry: Entry) -> bytes:
    """The entry's KV state, checked against the digest its head holds; ``Corrupt`` when it
    does not match (or the file changed size since it was indexed)."""
    with open(entry.path, "rb") as fh:
        fh.seek(entry.size - entry.state_len)
        data = fh.read(entry.state_len + 1)
    if len(data) != entry.state_len:
        raise Corrupt("state truncated")
    if hashlib.sha256(data).hexdigest() != entry.state_sum:
        raise Corrupt("state digest mismatch")
    return data


def write_entry(
    folder: Path,
    name: str,
    head: bytes,
    state: bytes,
    *,
    abandon: Callable[[], bool] = lambda: False,
    chunk: int = 8 << 20,
) -> Path:
    """Write a file atomically: to a temporary name, synced, then renamed over ``name``.
    ``abandon`` is asked between chunks; True stops the write (the temporary file is removed)
    and raises ``TimeoutError``."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / name
    tmp = folder / f"{name}{TMP_MARK}{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(head)
            view = memoryview(state)
            for i in range(0, len(view), chunk):
                if abandon():
                    raise TimeoutError("the save ran out of time")
                fh.write(view[i : i + chunk])
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power cut
        finally:
            os.close(fd)
    return final


def _files(root: Path) -> Iterator[os.DirEntry[str]]:
    # An unreadable folder (gone, or its permissions changed) holds nothing usable: the
    # heartbeat that reports it and the save that budgets it go on.
    try:
        models = list(os.scandir(root))
    except OSError:
        return
    for m in models:
        if not m.is_dir(follow_symlinks=False):
            continue
        try:
            files = list(os.scandir(m.path))
        except OSError:
            continue
        yield from files


def usage(root: Path) -> tuple[int, int]:
    """(entries, bytes) of the whole folder (every model of the host)."""
    n = total = 0
    for f in _files(root):
        if f.name.endswith(SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                total += f.stat(follow_symlinks=False).st_size
                n += 1
    return n, total


def make_room(root: Path, need: int, budget: int, keep: frozenset[Path] = frozenset()) -> bool:
    """Delete entries of the folder until ``need`` more bytes fit in ``budget``; False (nothing
    deleted) when they never could. Each deletion takes the least recently used entry of the
    owner whose entries hold the most bytes: one user's long conversations push out that user's
    own older entries before anyone else's, and a box with one user is plain LRU. ``keep``:
    entries not to delete (the ones this save supersedes are deleted by it)."""
    if need > budget:
        return False
    groups: dict[str, list[tuple[float, int, Path]]] = {}
    total = 0
    for f in _files(root):
        if not f.name.endswith(SUFFIX):
            continue
        try:
            st = f.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        total += st.st_size
        path = Path(f.path)
        if path not in keep:
            groups.setdefault(f.name.split("-", 1)[0], []).append((st.st_mtime, st.st_size, path))
    held = {tag: sum(size for _, size, _ in files) for tag, files in groups.items()}
    for files in groups.values():
        files.sort(reverse=True)  # least recently used last: popped first
    while total + need > budget and groups:
        tag = max(groups, key=lambda t: (held[t], -groups[t][-1][0]))
        _mtime, size, path = groups[tag].pop()
        if not groups[tag]:
            del groups[tag]
        held[tag] -= size
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            log.info("slot cache: %s out (over the disk budget)", path)
        total -= size
    return total + need <= budget


def disk_has_room(root: Path, need: int) -> bool:
    """Whether the disk under ``root`` keeps DISK_RESERVE_BYTES free after ``need`` more."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return False
    return free - need >= DISK_RESERVE_BYTES


def sweep_tmp(folder: Path, now: float | None = None, only: str | None = None) -> int:
    """Remove the temporary files of writers that died: those whose process is gone, or older
    than STALE_TMP_S (``only``: that file alone). Returns how many."""
    now = time.time() if now is None else now
    removed = 0
    try:
        files = list(os.scandir(folder))
    except OSError:
        return 0
    for f in files:
        if TMP_MARK not in f.name or (only is not None and f.name != only):
            continue
        pid_part = f.name.rsplit(TMP_MARK, 1)[1].split(".", 1)[0]
        try:
            age = now - f.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if _alive(pid_part) and age < STALE_TMP_S:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.path)
            removed += 1
    return removed


def _alive(pid: str) -> bool:
    try:
        n = int(pid)
    except ValueError:
        return False
    if n == os.getpid():
        return True
    try:
        os.kill(n, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def head_epochs(path: Path) -> tuple[int, int] | None:
    """The clear epochs an entry was saved under (None: not an entry that reads)."""
    try:
        with open(path, "rb") as fh:
            pre = fh.read(len(MAGIC) + _DIGEST + _LEN.size)
            if len(pre) < len(MAGIC) + _DIGEST + _LEN.size or not pre.startswith(MAGIC):
                return None
            (n_head,) = _LEN.unpack(pre[-_LEN.size :])
            if n_head > MAX_HEAD:
                return None
            head = json.loads(fh.read(n_head))
        return int(head["epoch_all"]), int(head["epoch_model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def purge_cleared(root: Path, epochs: dict[str, int]) -> int:
    """Delete every entry of the folder saved before a clear (``epochs``: ``"*"`` and each
    model's current clear epoch, 0 when never cleared), every file that reads as no entry, and
    the temporary files of writers that died. Returns how many were deleted."""
    every = epochs.get("*", 0)
    n = 0
    for f in _files(root):
        if not f.name.endswith(SUFFIX):
            # A dead writer's temporary file (a model never loaded again is never scanned).
            if TMP_MARK in f.name:
                n += sweep_tmp(Path(f.path).parent, only=f.name)
            continue
        model = Path(f.path).parent.name
        got = head_epochs(Path(f.path))
        if got is not None and got == (every, epochs.get(model, 0)):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f.path)
            n += 1
    return n


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Leading tokens ``a`` and ``b`` share (vectorized: entries hold thousands)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
