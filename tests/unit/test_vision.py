"""Images for a model that cannot see (``residency.vision``)."""

from __future__ import annotations

from typing import Any

import pytest

from residency.errors import ApiError
from residency.settings import ModelSpec
from residency.vision import first_image, refuse_images, sees

LOCAL = ModelSpec(path="/m/a.gguf")
REMOTE = ModelSpec(base_url="http://10.0.0.5:8080/v1")
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}


def params(*messages: Any) -> dict[str, Any]:
    return {"messages": list(messages)}


def test_the_first_image_part_is_found_in_any_message() -> None:
    text = {"role": "user", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": "what"}, IMAGE]}
    assert first_image([text, parts]) == (1, 1)
    assert first_image([text]) is None
    assert first_image(None) is None


def test_a_local_model_refuses_an_image_naming_itself_and_the_part() -> None:
    with pytest.raises(ApiError) as e:
        refuse_images(params({"role": "user", "content": ["x", IMAGE]}), "tiny", LOCAL)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert e.value.param == "messages[0].content[1]"
    assert e.value.code == "model_not_multimodal" and "'tiny'" in e.value.message


def test_text_only_passes_and_a_remote_model_decides_for_itself() -> None:
    refuse_images(params({"role": "user", "content": "hi"}), "tiny", LOCAL)
    refuse_images(params({"role": "user", "content": [IMAGE]}), "big", REMOTE)
    assert not sees(LOCAL) and sees(REMOTE)
