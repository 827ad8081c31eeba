"""Saved slot caches on disk (``workers.kvstore``, ``workers.slot_cache``): real files in a
temporary folder; the states are arbitrary bytes here (llama.cpp's own are saved and restored
in tests/integration/test_slot_restore.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from workers import kvstore
from workers.engine import SlotImage
from workers.kvstore import Stamp
from workers.slot_cache import MIN_SAVE_TOKENS, SlotCache
from workers.slots import Asker

STAMP = Stamp("spec-1", 0, 0)
FAR = time.monotonic() + 3600


def image(owner: str, tokens: list[int], size: int = 4096, fill: int = 1) -> SlotImage:
    return SlotImage(tokens, owner, 0, bytes([fill]) * size)


def conv(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def cache(root: Path, stamp: Stamp = STAMP, model: str = "a") -> SlotCache:
    c = SlotCache(root, model, stamp)
    c.scan()
    return c


def files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{kvstore.SUFFIX}"))


def test_a_saved_state_is_offered_back_with_its_bytes(tmp_path: Path) -> None:
    c = cache(tmp_path)
    report = c.save([image("ann", conv(40), fill=7)], 1 << 30, FAR)
    assert report.saved == 1 and not report.skipped
    again = cache(tmp_path)  # a later load
    r = again.offer([*conv(40), 1, 2], Asker("ann"), held=0)
    assert r is not None
    assert r.tokens == conv(40) and r.owner == "ann" and r.data == bytes([7]) * 4096
    # Not when a live slot already holds as much, nor for another user under scope user.
    assert again.offer([*conv(40), 1], Asker("ann"), held=40) is None
    assert again.offer([*conv(40), 1], Asker("bob"), held=0) is None


def test_short_slots_are_not_saved(tmp_path: Path) -> None:
    c = cache(tmp_path)
    assert c.save([image("ann", conv(MIN_SAVE_TOKENS - 1))], 1 << 30, FAR).saved == 0
    assert files(tmp_path) == []


@pytest.mark.parametrize("damage", ["flip_state", "flip_head", "flip_tokens", "truncate"])
def test_a_damaged_entry_is_deleted_and_counted_never_offered(tmp_path: Path, damage: str) -> None:
    cache(tmp_path).save([image("ann", conv(40))], 1 << 30, FAR)
    (path,) = files(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) - 100]
    else:
        at = {"flip_state": len(raw) - 10, "flip_head": 60, "flip_tokens": len(raw) - 4096 - 8}
        raw[at[damage]] ^= 0x40
    path.write_bytes(bytes(raw))
    c = cache(tmp_path)
    assert c.offer([*conv(40), 1], Asker("ann"), held=0) is None
    assert not path.exists()
    assert c.take_counts().bad == {"corrupt": 1}


def test_entries_of_another_spec_or_from_before_a_clear_are_stale(tmp_path: Path) -> None:
    cache(tmp_path).save([image("ann", conv(40))], 1 << 30, FAR)
    other = cache(tmp_path, Stamp("spec-2", 0, 0))
    assert other.usage() == (0, 0)
    assert other.take_counts().bad == {"stale": 1}
    assert files(tmp_path) == []
    for later in (Stamp("spec-1", 1, 0), Stamp("spec-1", 0, 1)):
        cache(tmp_path).save([image("ann", conv(40))], 1 << 30, FAR)
        assert cache(tmp_path, later).usage() == (0, 0)


def test_a_full_budget_sends_the_least_recently_used_entries_out(tmp_path: Path) -> None:
    c = cache(tmp_path)
    for i in range(3):  # u0, u1, u2, oldest first
        tokens = conv(40, 1000 * (i + 1))
        c.save([image(f"u{i}", tokens, 10_000)], 1 << 30, FAR)
        name = kvstore.entry_name(f"u{i}", np.asarray(tokens, dtype=np.int32))
        os.utime(tmp_path / "a" / name, (1_000_000 + i, 1_000_000 + i))
    entry_bytes = files(tmp_path)[0].stat().st_size
    # A restore makes u0 the most recently used.
    assert c.offer([*conv(40, 1000), 1], Asker("u0"), held=0) is not None
    assert c.save([image("u3", conv(40, 4000), 10_000)], 3 * entry_bytes, FAR).saved == 1
    assert len(files(tmp_path)) == 3
    kept = cache(tmp_path)
    for i, expected in enumerate((True, False, True, True)):
        found = kept.best([*conv(40, 1000 * (i + 1)), 1], Asker(f"u{i}")) is not None
        assert found is expected, f"u{i}"


def test_an_entry_larger_than_the_budget_or_the_disk_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = cache(tmp_path)
    assert c.save([image("ann", conv(40), 10_000)], 5_000, FAR).skipped == {"budget": 1}
    monkeypatch.setattr(kvstore, "DISK_RESERVE_BYTES", 1 << 62)  # no disk has that much free
    assert c.save([image("ann", conv(40))], 1 << 30, FAR).skipped == {"disk_full": 1}
    assert files(tmp_path) == []


def test_a_save_past_its_deadline_is_skipped(tmp_path: Path) -> None:
    c = cache(tmp_path)
    assert c.save([image("ann", conv(40))], 1 << 30, time.monotonic() - 1).skipped == {"timeout": 1}
    assert list(tmp_path.rglob("*")) == []


def test_a_conversation_that_went_on_replaces_its_older_entry(tmp_path: Path) -> None:
    c = cache(tmp_path)
    c.save([image("ann", conv(40)), image("bob", conv(40))], 1 << 30, FAR)
    c.save([image("ann", conv(60))], 1 << 30, FAR)
    assert c.usage()[0] == 2
    assert c.best([*conv(60), 1], Asker("ann")) is not None
    assert len(files(tmp_path)) == 2  # ann's longer one and bob's


CRASH = """
import os, sys
from pathlib import Path
from workers import kvstore
calls = []
def abandon():
    calls.append(1)
    if len(calls) == 2:
        os._exit(9)  # the process dies between two chunks of the state
    return False
name, state = "x" + kvstore.SUFFIX, b"s" * 4096
kvstore.write_entry(Path(sys.argv[1]), name, b"h", state, abandon=abandon, chunk=1024)
"""


def test_a_crash_mid_save_leaves_no_entry_that_loads(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    done = subprocess.run([sys.executable, "-c", CRASH, str(folder)], check=False)
    assert done.returncode == 9
    assert [p.name for p in folder.iterdir() if kvstore.TMP_MARK in p.name]  # half written
    assert files(tmp_path) == []
    c = cache(tmp_path)
    assert c.usage() == (0, 0)
    assert list(folder.iterdir()) == []  # the dead writer's temporary file is gone
    # And a file renamed into place whole but cut short (a power cut before the data reached
    # the disk) is found out by its size.
    c.save([image("ann", conv(40))], 1 << 30, FAR)
    (path,) = files(tmp_path)
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    assert cache(tmp_path).usage() == (0, 0)


def test_the_agent_sweep_deletes_what_a_clear_made_stale(tmp_path: Path) -> None:
    cache(tmp_path, model="a").save([image("ann", conv(40))], 1 << 30, FAR)
    cache(tmp_path, model="b").save([image("ann", conv(40))], 1 << 30, FAR)
    assert kvstore.purge_cleared(tmp_path, {}) == 0
    assert kvstore.usage(tmp_path)[0] == 2
    assert kvstore.purge_cleared(tmp_path, {"a": 1}) == 1
    assert [p.parent.name for p in files(tmp_path)] == ["b"]
    assert kvstore.purge_cleared(tmp_path, {"*": 1, "a": 1}) == 1
    assert kvstore.usage(tmp_path) == (0, 0)
    # A dead writer's temporary file in a folder no load will scan again goes too; a live
    # writer's stays.
    dead = tmp_path / "b" / f"x{kvstore.SUFFIX}{kvstore.TMP_MARK}999999999.ab"
    live = tmp_path / "b" / f"y{kvstore.SUFFIX}{kvstore.TMP_MARK}{os.getpid()}.cd"
    dead.write_bytes(b"half")
    live.write_bytes(b"half")
    assert kvstore.purge_cleared(tmp_path, {"*": 1, "a": 1}) == 1
    assert not dead.exists() and live.exists()


def test_common_prefix_is_the_leading_run() -> None:
    a = np.array([1, 2, 3, 4], dtype=np.int32)
    assert kvstore.common_prefix(a, np.array([1, 2, 9], dtype=np.int32)) == 2
    assert kvstore.common_prefix(a, a[:2]) == 2
    assert kvstore.common_prefix(a, np.array([], dtype=np.int32)) == 0


def test_a_sliding_window_model_restores_an_entry_only_from_its_whole_length(
    tmp_path: Path,
) -> None:
    """A saved state keeps only the window's last positions of its SWA layers: a prompt that
    diverges inside the entry cannot use it (llama.cpp would lack the positions it attends)."""
    c = cache(tmp_path)
    c.save([image("ann", conv(40))], 1 << 30, FAR)
    c.n_swa = 16
    assert c.best([*conv(40), 1], Asker("ann")) is not None
    assert c.best([*conv(30), 1], Asker("ann")) is None
    c.n_swa = 64  # the whole entry within the window: any prefix of it is whole there
    assert c.best([*conv(30), 1], Asker("ann")) is not None


def test_the_budget_takes_from_the_owner_holding_the_most_first(tmp_path: Path) -> None:
    """Ann's many entries push out her own oldest one, not bob's older single entry."""
    c = cache(tmp_path)
    saves = [("bob", 1000), ("ann", 2000), ("ann", 3000), ("ann", 4000)]
    for age, (owner, start) in enumerate(saves):
        tokens = conv(40, start)
        c.save([image(owner, tokens, 10_000)], 1 << 30, FAR)
        name = kvstore.entry_name(owner, np.asarray(tokens, dtype=np.int32))
        os.utime(tmp_path / "a" / name, (1_000_000 + age, 1_000_000 + age))
    budget = sum(p.stat().st_size for p in files(tmp_path))
    assert c.save([image("ann", conv(40, 5000), 10_000)], budget, FAR).saved == 1
    kept = cache(tmp_path)
    assert kept.best([*conv(40, 1000), 1], Asker("bob")) is not None  # the oldest, kept
    assert kept.best([*conv(40, 2000), 1], Asker("ann")) is None  # ann's oldest, out
    assert kept.best([*conv(40, 5000), 1], Asker("ann")) is not None
