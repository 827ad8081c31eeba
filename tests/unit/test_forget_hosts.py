"""When a gone host is forgotten (``forgettable``, pure): its models are reaped at once, but the
host stays listed until it has been gone ``worker.forget_after_s`` since its last heartbeat.
The host id every agent registers under is validated (``residency.hosts``)."""

from __future__ import annotations

import pytest

from residency import hosts
from residency.pool.decide import Forget, ModelView, Reap, Snapshot, WorkerView, decide, forgettable
from residency.settings import Settings, SettingsError
from residency.states import ModelState as S

NOW = 10_000.0


def snap(workers: dict[str, WorkerView], *models: ModelView) -> Snapshot:
    return Snapshot(models={m.name: m for m in models}, workers=workers, limits={"llm": 2}, now=NOW)


def gone(host: str, last_seen: float | None) -> WorkerView:
    return WorkerView(host, (), alive=False, last_seen=last_seen)


def test_a_gone_host_is_kept_until_forget_after_s_has_passed_since_it_was_last_seen() -> None:
    workers = {
        "recent": gone("recent", NOW - 599),
        "exactly": gone("exactly", NOW - 600),
        "old": gone("old", NOW - 3600),
        "alive": WorkerView("alive", ("cpu",), last_seen=NOW - 5000),
    }
    assert forgettable(snap(workers), 600) == Forget(("exactly", "old"), (), NOW - 600)
    # 0: as soon as it holds nothing, whenever it was last seen (the script checks no time).
    assert forgettable(snap(workers), 0) == Forget(("exactly", "old", "recent"), (), None)
    assert forgettable(snap(workers)) == forgettable(snap(workers), 0)


def test_a_gone_host_with_no_recorded_sighting_goes_at_once() -> None:
    assert forgettable(snap({"h": gone("h", None)}), 600) == Forget(("h",), (), NOW - 600)


def test_a_gone_host_is_kept_while_a_model_holds_a_slot_on_it_however_long_ago() -> None:
    held = ModelView("a", "llm", S.READY, token="T", host="old", device="cpu")
    s = snap({"old": gone("old", NOW - 3600), "box1": WorkerView("box1", ("cpu",))}, held)
    assert forgettable(s, 600) == Forget()
    # Its models do not wait for the host to be forgotten: they are reaped at once.
    assert Reap("a", "T", "host_gone") in decide(s)


def test_nothing_to_forget_carries_no_cutoff() -> None:
    s = snap({"box1": WorkerView("box1", ("cpu",), last_seen=NOW)})
    assert forgettable(s, 600) == Forget()


def test_forget_after_s_setting_defaults_and_bounds() -> None:
    assert Settings().worker.forget_after_s == 600.0
    assert Settings.model_validate({"worker": {"forget_after_s": 0}}).worker.forget_after_s == 0
    with pytest.raises(ValueError):
        Settings.model_validate({"worker": {"forget_after_s": -1}})


@pytest.mark.parametrize("host", ["alpha", "gpu-01.example.com", "node_7", "a" * hosts.MAX_LEN])
def test_valid_host_ids(host: str) -> None:
    assert hosts.host_id({"RESIDENCY_HOST": host}) == host


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("", "must not be empty"),
        ("a:b", "letters, digits"),
        ("two words", "letters, digits"),
        ("tab\t", "letters, digits"),
        ("-lead", "letters, digits"),
        ("a" * (hosts.MAX_LEN + 1), f"at most {hosts.MAX_LEN} characters"),
    ],
)
def test_invalid_host_ids_are_refused_naming_residency_host(host: str, why: str) -> None:
    with pytest.raises(SettingsError) as e:
        hosts.host_id({"RESIDENCY_HOST": host})
    assert list(e.value.problems) == ["RESIDENCY_HOST"]
    assert why in str(e.value)
    assert "RESIDENCY_HOST" in str(e.value)


def test_unset_residency_host_is_the_host_name_validated_too() -> None:
    assert hosts.host_id({}, hostname="box7") == "box7"
    with pytest.raises(SettingsError) as e:
        hosts.host_id({}, hostname="weird:name")
    assert "RESIDENCY_HOST: unset, and the host name 'weird:name'" in str(e.value)
