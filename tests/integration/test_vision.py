"""Images through a vision projector: the runtime with real llama.cpp and libmtmd, a tiny model
and its tiny projector (``residency tiny-model --mmproj``), nothing faked.

What is checked is what a vision request must get right: the image's positions are in the
prompt and prefilled (and counted), the same image again is a cached prefix and another image
never is, text that looks like a marker stays text, a bad image is the client's 400, and an
image is prefilled beside the other slots' generation, not instead of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from residency.errors import ApiError
from residency.settings import ModelSpec
from residency.tinymodel import N_EMBD, write_tiny_model
from residency.tinyprojector import IMAGE_TOKENS, write_tiny_projector
from tests.fixtures.images import data_url, png, png_declaring
from tests.integration.test_engine import Collector, Stepper, job
from workers.engine import Backend
from workers.runtime import LlamaRuntime


def vision_files(models_dir: Path) -> tuple[Path, Path]:
    model, proj = models_dir / "tiny-vision.gguf", models_dir / "tiny-vision-mmproj.gguf"
    if not proj.exists():
        write_tiny_model(model, seed=11)
        write_tiny_projector(proj, n_embd_text=N_EMBD, seed=11)
    return model, proj


@contextlib.contextmanager
def vision_runtime(
    models_dir: Path, parallel: int = 2, stepped: bool = False, mmproj: bool = True
) -> Iterator[tuple[LlamaRuntime, Stepper | None]]:
    model, proj = vision_files(models_dir)
    holder: list[Stepper] = []

    def wrap(b: Backend) -> Backend:
        holder.append(Stepper(b))
        return holder[0]

    rt = LlamaRuntime(wrap=wrap if stepped else None)
    spec = ModelSpec(
        path=str(model), mmproj=str(proj) if mmproj else None, n_ctx=1024, parallel=parallel
    )
    rt.load(spec, "cpu")
    try:
        yield rt, (holder[0] if holder else None)
    finally:
        if holder:
            holder[0].release_all()
        rt.close()


def ask(text: str, *images: bytes) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts}]


def image_positions(rt: LlamaRuntime) -> list[int]:
    """How many image positions each slot's memory holds (negative ids stand for them)."""
    return [sum(1 for t in s.cached if t < 0) for s in rt.engine.slots]


def test_an_image_fills_its_positions_and_they_are_prefilled_and_counted(
    models_dir: Path,
) -> None:
    with vision_runtime(models_dir) as (rt, _):
        e = rt.engine
        out = rt.chat({"messages": ask("what is this?", png()), "max_tokens": 4}, False)
        usage = out["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        # Every prompt position was decoded, the image's among them, and counted.
        assert e.prefilled == usage["prompt_tokens"]
        assert e.images_decoded == 1
        assert sorted(image_positions(rt)) == [0, IMAGE_TOKENS]
        assert rt.llm.projector.encoded == 1
        assert usage["prompt_tokens"] > IMAGE_TOKENS
        # Counting the prompt counts the image's positions too, and encodes nothing.
        assert rt.count_tokens({"messages": ask("what is this?", png())}) == {
            "input_tokens": usage["prompt_tokens"]
        }
        assert rt.llm.projector.encoded == 1


def test_the_same_image_again_is_a_cached_prefix_and_another_image_never_is(
    models_dir: Path,
) -> None:
    with vision_runtime(models_dir, parallel=1) as (rt, _):
        e = rt.engine
        first = ask("what is this?", png(seed=1))
        out = rt.chat({"messages": first, "max_tokens": 4, "temperature": 0}, False)
        answer = out["choices"][0]["message"]["content"]
        follow = [*first, {"role": "assistant", "content": answer}]
        follow.append({"role": "user", "content": "and now?"})
        out = rt.chat({"messages": follow, "max_tokens": 4}, False)
        # The conversation's next turn reused the image's positions: none decoded again.
        assert e.images_decoded == 1
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > IMAGE_TOKENS
        before = e.prefilled
        other = rt.chat({"messages": ask("what is this?", png(seed=2)), "max_tokens": 4}, False)
        usage = other["usage"]
        # The same text before it, another image: its positions are decoded, not reused.
        assert e.images_decoded == 2
        assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - (
            IMAGE_TOKENS
        )
        assert (
            e.prefilled - before
            == usage["prompt_tokens"] - (usage["prompt_tokens_details"]["cached_tokens"])
        )


def test_text_that_looks_like_a_marker_stays_text(models_dir: Path) -> None:
    with vision_runtime(models_dir, parallel=1) as (rt, _):
        # libmtmd's own marker, and one shaped like this server's: neither is an image.
        text = "see <__media__> and <__residency_image_0123456789abcdef__> here"
        rt.chat({"messages": ask(text, png()), "max_tokens": 2}, False)
        assert image_positions(rt) == [IMAGE_TOKENS]
        assert rt.engine.images_decoded == 1
        rt.chat({"messages": [{"role": "user", "content": text}], "max_tokens": 2}, False)
        assert rt.engine.images_decoded == 1


def test_a_bad_image_is_the_clients_400_naming_the_part(models_dir: Path) -> None:
    with vision_runtime(models_dir, parallel=1) as (rt, _):
        bad = ask("what is this?", b"this is not an image at all")
        with pytest.raises(ApiError) as e:
            rt.chat({"messages": bad, "max_tokens": 2}, False)
        assert e.value.status == 400
        assert e.value.param == "messages[0].content[1].image_url.url"
        not_base64 = ask("what is this?")
        not_base64[0]["content"].append(
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
        )
        with pytest.raises(ApiError) as e:
            rt.chat({"messages": not_base64, "max_tokens": 2}, False)
        assert e.value.param == "messages[0].content[1].image_url.url"
        # A few bytes declaring 40,000 x 40,000 pixels never reach the decoder.
        with pytest.raises(ApiError) as e:
            rt.chat({"messages": ask("what?", png_declaring(40000, 40000)), "max_tokens": 2}, False)
        assert "40000x40000" in e.value.message
        assert rt.engine.images_decoded == 0
        # Nothing was left behind: the model answers the next request.
        out = rt.chat({"messages": ask("hi"), "max_tokens": 2}, False)
        assert out["usage"]["completion_tokens"] == 2


def test_a_model_without_a_projector_refuses_an_image(models_dir: Path) -> None:
    with vision_runtime(models_dir, parallel=1, mmproj=False) as (rt, _):
        with pytest.raises(ApiError) as e:
            rt.chat({"messages": ask("what is this?", png()), "max_tokens": 2}, False)
        assert e.value.status == 400
        assert e.value.code == "model_not_multimodal"


def test_an_image_is_prefilled_while_three_text_streams_keep_generating(
    models_dir: Path,
) -> None:
    with vision_runtime(models_dir, parallel=4, stepped=True) as (rt, st):
        assert st is not None
        e = rt.engine
        texts = [Collector(rt, job(rt, f"story number {i}", 900)) for i in range(3)]
        # Stepped one at a time from here: between two steps the engine's counts are settled.
        while not all(c.tokens for c in texts):
            st.step()

        def generated() -> list[int]:
            return [s.generated for s in e.slots if s.job in [c.job for c in texts]]

        steps0, gen0 = e.steps, generated()
        result: dict[str, Any] = {}
        chat = threading.Thread(
            target=lambda: result.update(
                out=rt.chat({"messages": ask("describe it", png()), "max_tokens": 3}, False)
            ),
            daemon=True,
        )
        chat.start()
        while "out" not in result:
            st.step()
        steps = e.steps - steps0
        # Each of the three streams got a token at every step meanwhile, the image's step
        # included: the image was prefilled beside them, not instead of them.
        assert [g - g0 for g, g0 in zip(generated(), gen0, strict=True)] == [steps] * 3
        assert e.images_decoded == 1
        assert result["out"]["usage"]["completion_tokens"] == 3
        assert all(c.end is None for c in texts)
        for c in texts:
            c.job.cancel()


def test_each_encoded_image_counts_as_progress_before_the_first_step(models_dir: Path) -> None:
    # A real encoder on a CPU takes seconds an image: the stall watchdog must see them.
    with vision_runtime(models_dir, parallel=1, stepped=True) as (rt, st):
        assert st is not None
        progress: list[int] = []
        chat = threading.Thread(
            target=lambda: rt.chat(
                {"messages": ask("two", png(seed=5), png(seed=6)), "max_tokens": 1},
                False,
                on_progress=lambda: progress.append(rt.engine.steps),
            ),
            daemon=True,
        )
        chat.start()
        st.step()  # waits for the first step's decode: the job was submitted, encoded first
        assert progress[:2] == [0, 0]
        st.release_all()
        chat.join(60)
