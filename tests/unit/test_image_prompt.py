"""A chat request's images on their way into its prompt (``workers.image_prompt``), an image's
span in a job (``workers.engine.Job``), the tiny projector and the spec fields that name it."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from residency.cli import main
from residency.errors import ApiError
from residency.settings import ModelSpec, reasoning_markers
from residency.tinymodel import N_EMBD
from residency.tinyprojector import write_tiny_projector
from tests.fixtures.images import png
from workers import image_prompt
from workers.engine import Job, Media, Sampling

PNG = png(8, 8)
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def image_part(url: str = URL) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_prepare_puts_a_per_request_marker_where_each_image_was() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, image_part()]},
        {"role": "user", "content": [image_part(), {"type": "text", "text": "and this"}]},
    ]
    out, prompt = image_prompt.prepare(messages)
    assert out[0] == messages[0]
    assert out[1]["content"] == f"look\n{prompt.marker}"
    assert out[2]["content"] == f"{prompt.marker}\nand this"
    assert prompt.images == [PNG, PNG]
    assert prompt.params == [
        "messages[1].content[1].image_url.url",
        "messages[2].content[0].image_url.url",
    ]
    # A nonce per request: no client can know the next one.
    assert image_prompt.prepare(messages)[1].marker != prompt.marker


def test_tokenize_cuts_the_rendered_prompt_at_its_markers() -> None:
    _, prompt = image_prompt.prepare(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, image_part()]}]
    )
    text = f"<s>user a\n{prompt.marker}</s>assistant".encode()
    seen: list[tuple[bytes, bool]] = []

    def plain(part: bytes, bos: bool) -> list[int]:
        seen.append((part, bos))
        return [len(part)]

    tokens = image_prompt.tokenize(
        prompt,
        text,
        True,
        plain,
        lambda data, param: [7, ("img", 3), 8],
        lambda i: i[1],
        lambda i: -5,
    )
    assert seen == [(b"<s>user a\n", True), (b"</s>assistant", False)]
    assert tokens == [10, 7, -5, -5, -5, 8, 13]
    assert prompt.media == {2: ("img", 3)}


def test_a_template_that_drops_or_repeats_an_image_is_a_400() -> None:
    _, prompt = image_prompt.prepare(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, image_part()]}]
    )
    for text in (b"no marker here", f"{prompt.marker}{prompt.marker}".encode()):
        with pytest.raises(ApiError) as e:
            image_prompt.tokenize(
                prompt, text, True, lambda p, b: [], lambda d, p: [], lambda i: 0, lambda i: 0
            )
        assert e.value.status == 400 and e.value.param == "messages"


@pytest.mark.parametrize(
    "url",
    ["https://example.com/cat.png", "data:text/plain;base64,aGk=", "data:image/png,raw", "x"],
)
def test_only_a_base64_image_data_url_reaches_the_model(url: str) -> None:
    with pytest.raises(ApiError) as e:
        image_prompt.prepare([{"role": "user", "content": [image_part(url)]}])
    assert e.value.param == "messages[0].content[0].image_url.url"


def test_a_job_keeps_an_image_whole_and_its_text_before_the_next_one() -> None:
    prompt = [1, 2, -9, -9, -9, 3, -8, -8, 4]
    job = Job(prompt, 4, Sampling(), media={2: Media(3, None), 6: Media(2, None)})
    assert [job.whole_images(k) for k in range(9)] == [0, 1, 2, 2, 2, 5, 6, 6, 8]
    assert [job.next_image(k) for k in (0, 2, 3, 6, 7)] == [2, 2, 6, 6, 9]
    # The last prompt token is text: its logits give the first generated token.
    with pytest.raises(ValueError, match="image"):
        Job([1, -9, -9], 4, Sampling(), media={1: Media(2, None)})


def test_the_tiny_projector_is_deterministic_and_the_cli_writes_it(tmp_path: Path) -> None:
    a = write_tiny_projector(tmp_path / "a.gguf", n_embd_text=N_EMBD, seed=4)
    b = write_tiny_projector(tmp_path / "b.gguf", n_embd_text=N_EMBD, seed=4)
    assert a.read_bytes() == b.read_bytes()
    out = tmp_path / "m.gguf"
    assert main(["tiny-model", str(out), "--mmproj", str(tmp_path / "p.gguf")]) == 0
    assert out.is_file() and (tmp_path / "p.gguf").is_file()
    assert main(["tiny-model", str(out), "--embedding", "--mmproj", str(tmp_path / "q")]) == 2


def test_model_fields_for_images_reasoning_and_tool_formats_are_checked() -> None:
    assert reasoning_markers("<think>") == ("<think>", "</think>")
    assert reasoning_markers("[THINK]") == ("[THINK]", "[/THINK]")
    assert reasoning_markers("auto") is None
    for bad in ("think", "</think>", "<a b>"):
        with pytest.raises(ValueError):
            reasoning_markers(bad)
    with pytest.raises(ValueError, match="mmproj"):
        ModelSpec(base_url="http://x/v1", mmproj="/p.gguf")
    with pytest.raises(ValueError, match="mmproj"):
        ModelSpec(path="/m.gguf", type="embedding", mmproj="/p.gguf")
    with pytest.raises(ValueError, match="tool_format"):
        ModelSpec(path="/m.gguf", tool_format="xml")  # type: ignore[arg-type]
    assert ModelSpec(path="/m.gguf", mmproj="/p.gguf", reasoning="<think>").mmproj == "/p.gguf"
