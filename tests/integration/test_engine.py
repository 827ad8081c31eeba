"""The batched engine on real llama.cpp (the tiny GGUF), through the runtime the model process
uses: continuous batching, equal outputs batched or not, grammars in a full batch, logprobs,
stop strings, and the slot prompt cache.

Where a test must know what happened at each step (who joined when, which slot kept what), the
real backend sits behind ``Stepper``, which lets one ``llama_decode`` through per permit: same
interface, real decoding, the order decided by the test instead of the scheduler.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from residency.settings import ModelSpec
from workers.decode_threads import candidates
from workers.devices import default_threads
from workers.engine import Backend, End, Job, Sampling, Token
from workers.runtime import LlamaRuntime
from workers.slots import SlotState

WAIT_S = 60.0  # bounds a broken test only


class Stepper:
    """A backend whose ``decode`` waits for a permit from the test."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.n_vocab = inner.n_vocab
        self._permits = threading.Semaphore(0)
        self.decoded = threading.Semaphore(0)
        self.in_decode = threading.Event()  # set while the engine thread waits for a permit

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def decode(self) -> int:
        self.in_decode.set()
        assert self._permits.acquire(timeout=WAIT_S), "the test never let a step through"
        self.in_decode.clear()
        rc = self.inner.decode()
        self.decoded.release()
        return rc

    def until(self, pred: Callable[[], bool]) -> int:
        """Let decodes through one at a time until ``pred()`` holds (checked between them, and
        while the engine has nothing to decode); the steps it took."""
        steps, outstanding = 0, False
        deadline = time.monotonic() + WAIT_S
        while not pred():
            if not outstanding:
                self._permits.release()
                outstanding = True
            if self.decoded.acquire(timeout=0.005):
                steps, outstanding = steps + 1, False
                deadline = time.monotonic() + WAIT_S
            assert time.monotonic() < deadline, "condition not reached"
        return steps

    def step(self) -> None:
        """Let exactly one decode through and wait until the engine thread waits for the next
        permit: what it counts is then settled. Only while it has work to step (it waits in
        ``decode`` again, not for a job)."""
        assert self.in_decode.wait(WAIT_S), "the engine is not waiting for a step"
        self._permits.release()
        assert self.decoded.acquire(timeout=WAIT_S), "the step did not finish"
        # Cleared when the permit was taken, set when it waits for the next one.
        assert self.in_decode.wait(WAIT_S), "the engine did not come back for a step"

    def release_all(self) -> None:
        for _ in range(100000):
            self._permits.release()


def runtime(path: Path, parallel: int, n_ctx: int = 512, **kw: Any) -> LlamaRuntime:
    rt = LlamaRuntime(**kw)
    rt.load(ModelSpec(path=str(path), n_ctx=n_ctx, parallel=parallel), "cpu")
    return rt


@pytest.fixture
def tiny(models_dir: Path) -> Path:
    return models_dir / "tiny0.gguf"


@contextlib.contextmanager
def stepped_runtime(
    path: Path, parallel: int, n_ctx: int
) -> Iterator[tuple[LlamaRuntime, Stepper]]:
    """A runtime whose real backend sits behind a ``Stepper``; closed (every step let through
    first) on exit."""
    holder: list[Stepper] = []

    def wrap(b: Backend) -> Backend:
        holder.append(Stepper(b))
        return holder[0]

    rt = runtime(path, parallel=parallel, n_ctx=n_ctx, wrap=wrap)
    try:
        yield rt, holder[0]
    finally:
        holder[0].release_all()
        rt.close()


@pytest.fixture
def stepped(tiny: Path) -> Iterator[tuple[LlamaRuntime, Stepper]]:
    with stepped_runtime(tiny, parallel=5, n_ctx=2048) as pair:
        yield pair


class Collector:
    """Drains a job on its own thread, noting at which engine step each token came."""

    def __init__(self, rt: LlamaRuntime, job: Job) -> None:
        self.job = job
        self.tokens: list[Token] = []
        self.end: str | None = None
        self._rt = rt
        self.first_step: int | None = None
        self.end_step: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.job.next()
            step = self._rt.engine.steps
            if isinstance(item, End):
                self.end, self.end_step = item.reason, step
                return
            if self.first_step is None:
                self.first_step = step
            self.tokens.append(item)


def keep_busy(rt: LlamaRuntime, st: Stepper, n: int) -> list[Collector]:
    """``n`` long generations in slots of their own, each past its first token."""
    others = [Collector(rt, job(rt, f"someone else {i}", 1500)) for i in range(n)]
    st.until(lambda: all(c.tokens for c in others))
    return others


def job(rt: LlamaRuntime, text: str, max_tokens: int, **sampling: Any) -> Job:
    prompt = rt.llm.tokenize(text.encode(), add_bos=True, special=True)
    return rt.engine.submit(Job(prompt, max_tokens, Sampling(temperature=0, **sampling)))


def test_a_request_joins_the_running_batch_and_gets_its_first_token_before_the_others_end(
    stepped: tuple[LlamaRuntime, Stepper],
) -> None:
    rt, st = stepped
    first = [Collector(rt, job(rt, f"story number {i}", 40)) for i in range(3)]
    st.until(lambda: all(len(c.tokens) >= 5 for c in first))
    late = Collector(rt, job(rt, "a late arrival", 5))
    st.until(lambda: late.end is not None)
    # It got its tokens while the others were still generating: one batch, not a queue.
    assert late.first_step is not None and late.end_step is not None
    assert all(c.end is None for c in first)
    jobs = [c.job for c in first]
    assert all(s.state is SlotState.GENERATE for s in rt.engine.slots if s.job in jobs)
    st.until(lambda: all(c.end is not None for c in first))
    assert [c.end for c in first] == ["length"] * 3
    # Every step decoded all of them together: ~40 steps for 3 x 40 tokens, not 120.
    assert rt.engine.steps < 60


def test_outputs_at_temperature_0_are_the_same_batched_and_one_at_a_time(tiny: Path) -> None:
    prompts = [f"tell me about topic {i}" for i in range(4)]
    one = runtime(tiny, parallel=1)
    try:
        alone = [
            one.completion({"prompt": p, "max_tokens": 24, "temperature": 0, "seed": 7}, False)
            for p in prompts
        ]
    finally:
        one.close()
    four = runtime(tiny, parallel=4)
    try:
        out: dict[int, Any] = {}
        barrier = threading.Barrier(4)

        def go(i: int) -> None:
            barrier.wait()
            out[i] = four.completion(
                {"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "seed": 7}, False
            )

        threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        batched_steps = four.engine.steps
    finally:
        four.close()
    assert [o["choices"][0]["text"] for o in alone] == [
        out[i]["choices"][0]["text"] for i in range(4)
    ]
    assert all(o["usage"]["completion_tokens"] == 24 for o in alone)
    assert batched_steps < 4 * 24  # they did share steps


def test_the_decode_thread_count_is_measured_unless_configured_and_never_changes_tokens(
    tiny: Path,
) -> None:
    """Unset ``n_threads``: each step's count is chosen between all threads and one fewer
    (both measured on real decodes); set: it is used as it is. The tokens at temperature 0
    are the same with either count."""
    prompts = [f"count the threads {i}" for i in range(2)]
    params = {"max_tokens": 48, "temperature": 0, "seed": 3}
    texts: dict[str, list[str]] = {}
    for label, spec_threads in (("chosen", None), ("one", 1)):
        rt = LlamaRuntime()
        rt.load(ModelSpec(path=str(tiny), n_ctx=512, parallel=2, n_threads=spec_threads), "cpu")
        try:
            out: dict[int, Any] = {}

            def go(i: int, rt: LlamaRuntime = rt, out: dict[int, Any] = out) -> None:
                out[i] = rt.completion({"prompt": prompts[i], **params}, False)

            threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT_S)
            texts[label] = [out[i]["choices"][0]["text"] for i in range(2)]
            chooser = rt.engine.threads
            if spec_threads is None:
                assert chooser is not None
                assert chooser.options == candidates(default_threads())
                if len(chooser.options) > 1:
                    assert chooser.preferred(2) in chooser.options  # both were measured
            else:
                assert chooser is None
        finally:
            rt.close()
    assert texts["chosen"] == texts["one"]


@pytest.mark.parametrize(("setting", "llama_type"), [(None, -1), ("off", 0), ("on", 1)])
def test_flash_attention_is_llama_cpps_choice_unless_configured(
    tiny: Path, setting: str | None, llama_type: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, the context is made with llama.cpp's "auto" (as llama-server's default); "on" and
    "off" are passed as they are. Either way it generates."""
    from llama_cpp import _internals

    made: list[int] = []  # the flash attention type each context was created with

    class Recorded(_internals.LlamaContext):  # type: ignore[misc]
        def __init__(self, *, params: Any, **kw: Any) -> None:
            made.append(int(params.flash_attn_type))
            super().__init__(params=params, **kw)

    monkeypatch.setattr(_internals, "LlamaContext", Recorded)
    extra = {} if setting is None else {"flash_attn": setting}
    rt = LlamaRuntime()
    rt.load(ModelSpec(path=str(tiny), n_ctx=256, parallel=2, **extra), "cpu")
    try:
        assert made == [llama_type]
        out = rt.completion({"prompt": "flash", "max_tokens": 8, "temperature": 0}, False)
        assert out["usage"]["completion_tokens"] > 0
    finally:
        rt.close()


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_a_json_schema_answer_in_a_full_batch_parses_against_its_schema(
    stepped: tuple[LlamaRuntime, Stepper],
) -> None:
    rt, st = stepped
    others = keep_busy(rt, st, 4)
    box: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: box.update(
            out=rt.chat(
                {
                    "messages": [{"role": "user", "content": "a person as JSON"}],
                    "response_format": {"type": "json_object", "schema": SCHEMA},
                    "max_tokens": 300,
                    "temperature": 0,
                },
                False,
            )
        ),
        daemon=True,
    )
    t.start()
    st.until(lambda: rt.engine.busy() == 5)  # every slot taken: a full batch
    st.until(lambda: not t.is_alive())
    # The four others were in every step of it, and go on.
    assert all(c.end is None for c in others)
    for c in others:
        c.job.cancel()
    doc = json.loads(box["out"]["choices"][0]["message"]["content"])
    assert set(doc) == {"name", "age"}
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    assert isinstance(doc["age"], int)


def test_logprobs_and_stop_strings_work_batched(tiny: Path) -> None:
    rt = runtime(tiny, parallel=4)
    try:
        plain = rt.completion({"prompt": "abc", "max_tokens": 12, "temperature": 0}, False)
        text = plain["choices"][0]["text"]
        # Stop at a piece of the text it would write: the answer ends just before it.
        cut = text[4:7]
        assert cut.strip()
        stopped = rt.completion(
            {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": [cut]}, False
        )
        assert stopped["choices"][0]["text"] == text[: text.index(cut)]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        chunks = list(
            rt.completion(
                {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": [cut]}, True
            )
        )
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert streamed == stopped["choices"][0]["text"]
        lp = rt.completion(
            {"prompt": "abc", "max_tokens": 6, "temperature": 0, "logprobs": 3}, False
        )["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 6
        assert "".join(lp["tokens"]) == text[: len("".join(lp["tokens"]))]
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert chosen <= 0
            # Greedy: the chosen token is the most likely one.
            assert chosen == pytest.approx(max(top.values()))
            assert len(top) <= 4
        chat = rt.chat(
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "logprobs": True,
                "top_logprobs": 2,
            },
            False,
        )
        assert isinstance(chat, dict)
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == 4 and all(len(c["top_logprobs"]) >= 2 for c in content)
    finally:
        rt.close()


def test_a_seed_repeats_a_sampled_answer(tiny: Path) -> None:
    rt = runtime(tiny, parallel=2)
    try:
        params = {"prompt": "once upon", "max_tokens": 16, "temperature": 1.0, "seed": 42}
        a = rt.completion(params, False)["choices"][0]["text"]
        b = rt.completion(params, False)["choices"][0]["text"]
        c = rt.completion({**params, "seed": 43}, False)["choices"][0]["text"]
    finally:
        rt.close()
    assert a == b
    assert a != c


def conversation_turn(history: list[dict[str, str]], i: int) -> list[dict[str, str]]:
    # ~100 tokens of new user text a turn (the tiny vocabulary spells most words by pieces).
    words = " ".join(f"word{i}x{j}" for j in range(25))
    return [*history, {"role": "user", "content": f"turn {i}: {words}"}]


def test_a_follow_up_turn_prefills_only_its_new_tokens_with_four_slots_busy(
    stepped: tuple[LlamaRuntime, Stepper],
) -> None:
    rt, st = stepped
    others = keep_busy(rt, st, 4)
    history: list[dict[str, str]] = []
    for i in range(10):
        history = conversation_turn(history, i)
    assert rt.engine.busy() == 4

    def ask(messages: list[dict[str, str]]) -> dict[str, Any]:
        box: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: box.update(
                out=rt.chat({"messages": messages, "max_tokens": 8, "temperature": 0}, False)
            ),
            daemon=True,
        )
        t.start()
        st.until(lambda: not t.is_alive())
        return box["out"]

    before = rt.engine.prefilled
    first = ask(history)
    usage1 = first["usage"]
    assert usage1["prompt_tokens"] > 1000
    assert usage1["prompt_tokens_details"]["cached_tokens"] == 0
    assert rt.engine.prefilled - before == usage1["prompt_tokens"]

    history = conversation_turn(
        [*history, {"role": "assistant", "content": first["choices"][0]["message"]["content"]}],
        10,
    )
    before = rt.engine.prefilled
    second = ask(history)
    usage2 = second["usage"]
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    # The whole first prompt came from its slot; only what is new was decoded.
    assert cached >= usage1["prompt_tokens"]
    assert rt.engine.prefilled - before == usage2["prompt_tokens"] - cached
    assert usage2["prompt_tokens"] - cached < 200
    # The others kept their slots and went on generating throughout.
    assert all(c.end is None for c in others)
    assert rt.engine.busy() == 4
    for c in others:
        c.job.cancel()
