"""What a load of each cold router candidate would take (pure): the pool's own decisions, with
every resident taken as idle and every turn as over."""

from __future__ import annotations

from pathlib import Path

from residency import ledger
from residency.policies.floor import Floor
from residency.pool import route_room
from residency.pool.autosize import Autosize
from residency.pool.decide import ModelView
from residency.pool.route_room import asked, published, room, unloaded_s
from residency.pool.snapshot import Read, _load_s
from residency.settings import ModelSpec
from residency.states import ModelState as S
from tests.unit.test_decide import mv, snap
from tests.unit.test_decide_ledger import MB, NOW, dev, need, res


def cold(name: str, n_mb: int, **kw: object) -> ModelView:
    return mv(name, need_bytes=need(n_mb), **kw)


def test_a_cold_candidate_that_fits_without_eviction() -> None:
    s = snap(res("x", 300), cold("y", 300), limit=-1, workers={"box1": dev()})
    assert room(s, "y") == {
        "fits": True,
        "reason": "fits",
        "evict": [],
        "turn_left": {},
        "unload_s": {},
        "load_s": None,
        "load_bytes": 300 * MB,
    }


def test_the_lru_resident_goes_and_a_busy_one_is_taken_as_idle() -> None:
    # The pool holds its limit (2). "old" is the least recently used but busy: the pool would
    # not evict it now, but the router adds its wait from live counts, so it is the victim.
    models = [
        res("old", 100, last_used=NOW - 900, in_flight=1, queued=2),
        res("new", 100, last_used=NOW - 10),
        cold("y", 100),
    ]
    a = room(snap(*models, limit=2, workers={"box1": dev()}), "y")
    assert (a["fits"], a["reason"], a["evict"], a["turn_left"]) == (
        True,
        "after_evictions",
        ["old"],
        {"old": 0.0},
    )


def test_pinned_residents_are_never_listed() -> None:
    models = [res("p", 100, pinned=True, last_used=NOW - 900), res("q", 100), cold("y", 100)]
    a = room(snap(*models, limit=2, workers={"box1": dev()}), "y")
    assert (a["fits"], a["evict"]) == (True, ["q"])
    pinned = [res("p", 100, pinned=True), res("q", 100, pinned=True), cold("y", 100)]
    a = room(snap(*pinned, limit=2, workers={"box1": dev()}), "y")
    assert (a["fits"], a["reason"], a["evict"]) == (False, "slots_pinned", [])


def test_a_model_too_large_for_every_device() -> None:
    a = room(snap(cold("y", 5000), limit=-1, workers={"box1": dev()}), "y")
    assert (a["fits"], a["reason"], a["evict"], a["load_bytes"]) == (
        False,
        "too_large",
        [],
        5000 * MB,
    )


def test_a_victim_in_its_turn_says_how_long_its_turn_has_left() -> None:
    # x was loaded a second ago and served a request 0.1 s ago: its turn (min_resident_s=10,
    # turn_idle_s=0.5) ends 0.4 s from now; the room is what the pool gives once it ends.
    x = res("x", 900, loaded_at=NOW - 1, last_used=NOW - 0.1)
    s = snap(x, cold("y", 300), limit=-1, min_resident_s=10.0, workers={"box1": dev()})
    a = room(s, "y")
    assert (a["fits"], a["evict"]) == (True, ["x"])
    assert abs(a["turn_left"]["x"] - 0.4) < 1e-6
    # Past its turn it has none left.
    later = snap(x, cold("y", 300), limit=-1, min_resident_s=10.0, workers={"box1": dev()},
                 now=NOW + 1)  # fmt: skip
    assert room(later, "y")["turn_left"] == {"x": 0.0}


def test_each_victim_with_a_measured_unload_says_how_long_it_took() -> None:
    models = [res("old", 100, last_used=NOW - 900), res("new", 100, last_used=NOW - 800)]
    s = snap(*models, cold("y", 100), limit=2, workers={"box1": dev()})
    # Only the victims' (never another model's), and only those that have one.
    a = room(s, "y", None, {"old": 2.5, "new": 7.0, "y": 9.0, "gone": 1.0})
    assert (a["evict"], a["unload_s"]) == (["old"], {"old": 2.5})
    assert room(s, "y", None, {"new": 7.0})["unload_s"] == {}
    assert room(s, "y")["unload_s"] == {}


def test_unload_seconds_are_read_from_the_model_hashes() -> None:
    hashes = {
        "a": {"state": "unloaded", "unload_s": "1.250"},
        "b": {"state": "ready"},  # never unloaded
        "c": {"unload_s": "x"},  # damaged
        "d": {"unload_s": "0.000"},
    }
    assert unloaded_s(hashes) == {"a": 1.25, "d": 0.0}


def test_a_pass_publishes_the_victims_unload_seconds() -> None:
    models = [res("old", 100, last_used=NOW - 900), cold("y", 100), cold("z", 50)]
    s = snap(*models, limit=1, workers={"box1": dev()})
    floor = Floor(2, {"auto": 2}, [], frozenset({"y", "z", "old"}))
    rd = Read(
        snap=s,
        model_hashes={"old": {"state": "ready", "unload_s": "3.5"}, "z": {"unload_s": "0.5"}},
        worker_hashes={},
        autosize=Autosize(False, 1, floor, 1, True),
    )
    out = published(rd)
    assert list(out["models"]) == ["y", "z"]
    for name in ("y", "z"):
        assert (out["models"][name]["evict"], out["models"][name]["unload_s"]) == (
            ["old"],
            {"old": 3.5},
        )


def test_measured_load_seconds_hold_for_the_device_kind_it_would_load_on() -> None:
    s = snap(cold("y", 300), limit=-1, workers={"box1": dev()})
    assert room(s, "y", {"cpu": 3.5})["load_s"] == 3.5
    assert room(s, "y", {"cuda": 3.5})["load_s"] is None


def test_load_seconds_count_only_under_the_current_spec(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    spec = ModelSpec(path=str(path), n_ctx=512)
    kinds = {"cpu": "cpu"}
    digest = ledger.digest(spec, "cpu")
    assert _load_s(spec, kinds, {"load_s": "2.5", "load_spec": str(digest)}) == {"cpu": 2.5}
    # A load of another spec (here another context size) says nothing about the next one.
    other = ledger.digest(ModelSpec(path=str(path), n_ctx=1024), "cpu")
    assert other != digest
    assert _load_s(spec, kinds, {"load_s": "2.5", "load_spec": str(other)}) == {}
    assert _load_s(spec, kinds, {"load_s": "2.5"}) == {}
    assert _load_s(spec, kinds, {"load_s": "nan", "load_spec": str(digest)}) == {}
    assert _load_s(spec, kinds, {"load_s": "x", "load_spec": str(digest)}) == {}


def test_the_room_is_asked_for_cold_registered_llm_candidates_only() -> None:
    models = [
        res("ready", 100),
        mv("loading", S.LOADING),
        mv("cold"),
        mv("failed", S.FAILED),
        mv("gone", registered=False),
        mv("emb", type="embedding"),
    ]
    s = snap(*models, limit=-1, workers={"box1": dev()})
    names = frozenset({"ready", "loading", "cold", "failed", "gone", "emb", "unknown"})
    assert asked(s, names) == ["cold", "failed"]
    assert asked(s, frozenset({"ready"})) == []


def test_idle_leaves_cold_models_as_they_are() -> None:
    s = snap(res("x", 100, in_flight=2, queued=3), mv("y", queued=4), limit=-1)
    out = route_room.idle(s)
    assert (out.models["x"].in_flight, out.models["x"].queued) == (0, 0)
    assert out.models["y"].queued == 4
