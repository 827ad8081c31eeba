"""Slot states saved, restored, copied and waited for, on real llama.cpp (the tiny GGUF) through
the runtime the model process uses: what a request prefills after each, and that its answer at
temperature 0 is the one a cold slot gives.

Where the order of steps matters (a request arriving while another still runs), the real
backend sits behind ``Stepper`` (one ``llama_decode`` per permit from the test).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from residency.settings import ModelSpec
from tests.integration.test_engine import WAIT_S, Collector, Stepper, stepped_runtime
from workers.engine import Job, Sampling
from workers.kvstore import Stamp
from workers.runtime import LlamaRuntime
from workers.slot_cache import MIN_SAVE_TOKENS, SlotCache, spec_digest
from workers.slots import Asker

SYSTEM = "You are the helpdesk of " + " ".join(f"dept{j}" for j in range(20))


def load(path: Path, parallel: int = 2, n_ctx: int = 1024) -> LlamaRuntime:
    rt = LlamaRuntime()
    rt.load(ModelSpec(path=str(path), n_ctx=n_ctx, parallel=parallel), "cpu")
    return rt


def attach(rt: LlamaRuntime, root: Path, path: Path, parallel: int, n_ctx: int = 1024) -> SlotCache:
    spec = ModelSpec(path=str(path), n_ctx=n_ctx, parallel=parallel)
    c = SlotCache(root, "a", Stamp(spec_digest(spec, parallel, rt.state_format)))
    c.scan()
    rt.attach_cache(c)
    return c


def tokens(rt: LlamaRuntime, text: str) -> list[int]:
    return list(rt.llm.tokenize(text.encode(), add_bos=True, special=True))


def run(rt: LlamaRuntime, prompt: list[int], user: str, n: int = 12, **asker: object) -> Job:
    """Submit ``prompt`` as ``user`` (offering a saved state, as ``completion.create`` does)
    and drain it; the job, with its tokens in ``job.out_tokens``."""
    ask = Asker(user, **asker)  # type: ignore[arg-type]
    cache = rt.llm.slot_cache
    restore = (
        None if cache is None else cache.offer(prompt, ask, rt.engine.held_prefix(prompt, ask))
    )
    job = Job(prompt, n, Sampling(temperature=0), asker=ask, restore=restore)
    c = Collector(rt, rt.engine.submit(job))
    c.thread.join(WAIT_S)
    job.out_tokens = [t.id for t in c.tokens]  # type: ignore[attr-defined]
    return job


@pytest.fixture
def tiny(models_dir: Path) -> Path:
    return models_dir / "tiny0.gguf"


def save(rt: LlamaRuntime, c: SlotCache) -> None:
    c.save(rt.slot_images(MIN_SAVE_TOKENS, WAIT_S), 1 << 30, time.monotonic() + WAIT_S)


def saved_turn(tiny: Path, root: Path, text: str) -> tuple[list[int], Job]:
    """``text`` asked by ann on a model with two slots, whose slots are then saved into
    ``root`` and the model unloaded: the prompt's tokens and the finished job."""
    rt = load(tiny)
    try:
        c = attach(rt, root, tiny, 2)
        prompt = tokens(rt, SYSTEM + text)
        job = run(rt, prompt, "ann")
        save(rt, c)
    finally:
        rt.close()
    return prompt, job


def test_a_restored_conversation_prefills_only_its_new_tokens_and_answers_as_a_cold_one(
    tiny: Path, tmp_path: Path
) -> None:
    turn1, first = saved_turn(tiny, tmp_path, " question one")
    held = turn1 + first.out_tokens[:-1]  # the last sampled token was never decoded
    warm = load(tiny)
    try:
        turn2 = held + tokens(warm, " and the next one")[1:]
        c = attach(warm, tmp_path, tiny, 2)
        assert c.usage()[0] == 1
        before = warm.engine.prefilled
        restored = run(warm, turn2, "ann")
        assert restored.cached == len(held)
        assert warm.engine.prefilled - before == len(turn2) - len(held)  # only the new tokens
        assert warm.engine.restored == 1
        assert c.take_counts().restored_tokens == len(held)
    finally:
        warm.close()
    cold = load(tiny)
    try:
        again = run(cold, turn2, "ann")
        assert again.cached == 0
    finally:
        cold.close()
    assert restored.out_tokens == again.out_tokens


def test_another_users_entry_is_never_restored_under_scope_user(tiny: Path, tmp_path: Path) -> None:
    prompt, _ = saved_turn(tiny, tmp_path, " a secret question")
    rt = load(tiny)
    try:
        attach(rt, tmp_path, tiny, 2)
        bob = run(rt, prompt, "bob")
        assert bob.cached == 0 and rt.engine.restored == 0
        ann = run(rt, prompt + tokens(rt, " more")[1:], "ann")
        assert ann.cached >= len(prompt) and rt.engine.restored == 1
    finally:
        rt.close()


@pytest.mark.parametrize("change", [{"parallel": 1}, {"n_ctx": 768}])
def test_an_entry_saved_under_another_slot_layout_is_never_restored(
    tiny: Path, tmp_path: Path, change: dict[str, int]
) -> None:
    prompt, _ = saved_turn(tiny, tmp_path, " layout")
    parallel, n_ctx = change.get("parallel", 2), change.get("n_ctx", 1024)
    rt = load(tiny, parallel=parallel, n_ctx=n_ctx)
    try:
        c = attach(rt, tmp_path, tiny, parallel, n_ctx)
        assert c.usage() == (0, 0)
        assert c.take_counts().bad == {"stale": 1}
        assert run(rt, [*prompt, 1, 2], "ann").cached == 0
    finally:
        rt.close()


@pytest.fixture
def stepped(tiny: Path) -> Iterator[tuple[LlamaRuntime, Stepper]]:
    with stepped_runtime(tiny, parallel=3, n_ctx=1024) as pair:
        yield pair


def submit(rt: LlamaRuntime, prompt: list[int], user: str, n: int, **asker: object) -> Collector:
    return Collector(
        rt,
        rt.engine.submit(Job(prompt, n, Sampling(temperature=0), asker=Asker(user, **asker))),  # type: ignore[arg-type]
    )


def test_a_shared_prefix_is_copied_from_a_busy_slot_instead_of_prefilled(
    stepped: tuple[LlamaRuntime, Stepper], tiny: Path
) -> None:
    rt, st = stepped
    system = tokens(rt, SYSTEM)
    ann = submit(rt, system + tokens(rt, " ann asks")[1:], "ann", 200, scope="global")
    st.until(lambda: len(ann.tokens) >= 3)
    bob_prompt = system + tokens(rt, " bob asks")[1:]
    bob = submit(rt, bob_prompt, "bob", 12, scope="global")
    st.until(lambda: bob.end is not None)
    assert rt.engine.copied == 1
    shared = next(
        i for i, (x, y) in enumerate(zip(ann.job.prompt, bob_prompt, strict=False)) if x != y
    )
    assert bob.job.cached == shared
    st.release_all()
    ann.thread.join(WAIT_S)
    cold = load(tiny, parallel=1)
    try:
        alone = run(cold, bob_prompt, "bob")
    finally:
        cold.close()
    assert [t.id for t in bob.tokens] == alone.out_tokens


def test_a_follow_up_waits_for_its_own_slot_that_is_finishing(
    stepped: tuple[LlamaRuntime, Stepper],
) -> None:
    rt, st = stepped
    prompt = tokens(rt, SYSTEM + " tell me a long story")
    first = submit(rt, prompt, "ann", 500)
    st.until(lambda: len(first.tokens) >= 6)
    # The client read four tokens, stopped reading, and asked again; its stream's cancel has
    # not reached the engine yet.
    seen = [t.id for t in first.tokens[:4]]
    follow = prompt + seen + tokens(rt, " go on")[1:]
    second = submit(rt, follow, "ann", 8)
    st.until(lambda: second.job.wait_since is not None)
    st.until(lambda: rt.engine.steps >= second.job.wait_since + 2)  # it keeps waiting
    assert any(s.job is first.job for s in rt.engine.slots)
    assert second.job.cached == 0 and not any(s.job is second.job for s in rt.engine.slots)
    first.job.cancel()  # the cancel arrives
    st.until(lambda: second.end is not None)
    assert rt.engine.waits == {"own": 1, "copied": 0, "cold": 0}
    assert second.job.cached == len(prompt) + len(seen)
    assert rt.engine.copied == 0


def test_a_save_never_waits_past_its_bound_for_a_busy_engine_thread(
    stepped: tuple[LlamaRuntime, Stepper],
) -> None:
    """The drain's save asks the engine thread for the slots' states; when that thread is held
    (here: inside a decode the test does not let finish), the ask ends at its bound with
    TimeoutError, and the unload goes on without a save."""
    rt, st = stepped
    busy = submit(rt, tokens(rt, SYSTEM), "ann", 50)
    st.until(lambda: len(busy.tokens) >= 1)
    # The engine thread is now held in its next decode, waiting for a permit that never comes.
    assert st.in_decode.wait(WAIT_S)
    with pytest.raises(TimeoutError):
        rt.slot_images(MIN_SAVE_TOKENS, 0.2)
    st.release_all()
    busy.thread.join(WAIT_S)
    assert busy.end == "length"
