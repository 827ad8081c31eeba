"""No system message is dropped: every chat handler a model can be served with, loaded by the
real runtime on a tiny GGUF (llama.cpp), renders every system text of a conversation, or the
request is refused naming the message; a GGUF's own template wins over a built-in
``chat_format``; and through the HTTP API, a long system message costs its tokens on a model
served with ``chat_format = "gemma"``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_cpp import llama_chat_format

from residency.errors import ApiError
from residency.settings import ModelSpec
from residency.tinymodel import write_tiny_model
from tests.conftest import Pool, tiny_models
from tests.integration.gemma_template import GEMMA_TEMPLATE
from tests.integration.test_pool import client_for
from tests.integration.tools_template import TOOLS_TEMPLATE
from workers import chat_tools
from workers.chat_handler import GGUF_TEMPLATE
from workers.runtime import LlamaRuntime

#: Every chat format and handler llama-cpp-python registers by name.
FORMATS = sorted(llama_chat_format.LlamaChatCompletionHandlerRegistry()._chat_handlers)
SYSTEM_TEXTS = ("alphasys", "betasys", "gammasys")
CONVERSATION: Any = [
    {"role": "system", "content": "alphasys"},
    {"role": "developer", "content": "betasys"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi"},
    {"role": "system", "content": "gammasys"},  # sent mid-conversation, as Claude Code does
    {"role": "user", "content": "world"},
]


@pytest.fixture(scope="module")
def gguf(models_dir: Path) -> Callable[[str, str | None], Path]:
    """A tiny GGUF with ``template`` (None: none) in the pool's model directory."""

    def write(name: str, template: str | None) -> Path:
        path = models_dir / f"system-{name}.gguf"
        if not path.exists():
            write_tiny_model(path, seed=4, chat_template=template)
        return path

    return write


@pytest.fixture
def load() -> Iterator[Callable[[Path, str | None], LlamaRuntime]]:
    loaded: list[LlamaRuntime] = []

    def _load(path: Path, chat_format: str | None) -> LlamaRuntime:
        rt = LlamaRuntime()
        rt.load(ModelSpec(path=str(path), n_ctx=512, parallel=1, chat_format=chat_format), "cpu")
        loaded.append(rt)
        return rt

    yield _load
    for rt in loaded:
        rt.close()


def test_the_registry_holds_the_formats_this_file_knows_of() -> None:
    # A llama-cpp-python upgrade that adds one runs it through the test below by itself; this
    # only says the enumeration is not empty.
    assert {"gemma", "chatml", "llama-2", "functionary"} <= set(FORMATS)


@pytest.mark.parametrize("name", FORMATS)
def test_every_built_in_format_renders_every_system_text(
    name: str,
    gguf: Callable[[str, str | None], Path],
    load: Callable[[Path, str | None], LlamaRuntime],
) -> None:
    """A GGUF without a template, served with ``chat_format = name``: the rendered prompt
    holds the leading, the developer and the mid-conversation system text, and the user
    turns; or the request is refused naming a system message (a handler that renders no user
    text either, so none can carry it); or the handler renders nothing at all (it refuses
    every request, e.g. functionary-v2 without its Hugging Face tokenizer) — never a prompt
    without them."""
    rt = load(gguf("bare", None), name)
    try:
        prompt = rt.render(CONVERSATION)
    except ApiError as e:
        assert e.status == 400 and e.code == "invalid_messages"
        assert e.param is not None and e.param.endswith(".role")
        assert CONVERSATION[int(e.param[len("messages[") :].split("]")[0])]["role"] != "user"
        assert not rt.system_roles.folds
        return
    if prompt is None:
        assert rt.render([{"role": "user", "content": "hello"}]) is None
        return
    for text in (*SYSTEM_TEXTS, "hello", "world"):
        assert text in prompt, f"{name} lost {text!r}: {prompt!r}"


def test_gemma_folds_the_system_text_into_the_first_user_turn(
    gguf: Callable[[str, str | None], Path], load: Callable[[Path, str | None], LlamaRuntime]
) -> None:
    rt = load(gguf("bare", None), "gemma")
    prompt = rt.render([{"role": "system", "content": "Be brief."}, CONVERSATION[2]])
    # (The handler hands over tokens: the text read back starts with the BOS token.)
    assert prompt is not None and prompt.endswith(
        "<start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n<start_of_turn>model\n"
    )


def test_the_ggufs_own_template_wins_over_a_built_in_format(
    gguf: Callable[[str, str | None], Path], load: Callable[[Path, str | None], LlamaRuntime]
) -> None:
    """Gemma-style template, ``chat_format = "gemma"``: the template renders the prompt (it
    folds the leading system text itself), and the system messages it refuses (a second
    leading one, one mid-conversation: roles must alternate) are folded before it sees them,
    so the conversation is neither refused nor stripped."""
    rt = load(gguf("gemma-template", GEMMA_TEMPLATE), "gemma")
    assert rt.llm.chat_format == GGUF_TEMPLATE
    prompt = rt.render(CONVERSATION)
    assert prompt is not None
    assert "<start_of_turn>user\nalphasys\n\nbetasys\n\nhello<end_of_turn>" in prompt
    assert "<start_of_turn>user\ngammasys\n\nworld<end_of_turn>" in prompt


def test_tool_support_follows_the_template_that_renders(
    gguf: Callable[[str, str | None], Path], load: Callable[[Path, str | None], LlamaRuntime]
) -> None:
    """``chat_format = "chatml"`` on a GGUF whose template takes tools: the template wins, and
    so the model takes tools through it."""
    rt = load(gguf("tools-template", TOOLS_TEMPLATE), "chatml")
    assert rt.llm.chat_format == GGUF_TEMPLATE
    assert rt._tools == chat_tools.TEMPLATE


# --- through the HTTP API ---------------------------------------------------------------------

LONG_SYSTEM = " ".join(["the world is how it is and you are in it"] * 40)


def test_a_long_system_message_costs_its_tokens_on_a_gemma_format_model(
    start_pool: Callable[..., Pool], gguf: Callable[[str, str | None], Path], models_dir: Path
) -> None:
    models = tiny_models(models_dir)
    models["g"] = {"path": str(gguf("bare", None)), "n_ctx": 2048, "parallel": 1}
    models["g"]["chat_format"] = "gemma"
    pool = start_pool(models=models)
    c = client_for(pool)
    question = {"role": "user", "content": "hello"}

    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        resp = c.post(
            "/v1/chat/completions", json={"model": "g", "messages": messages, "max_tokens": 1}
        )
        assert resp.status_code == 200, resp.get_json()
        return int(resp.get_json()["usage"]["prompt_tokens"])

    alone = prompt_tokens([question])
    with_system = prompt_tokens([{"role": "system", "content": LONG_SYSTEM}, question])
    assert with_system > alone + 200
    # Sent mid-conversation it costs the same tokens, in the turn it was sent with.
    later = [question, {"role": "assistant", "content": "hi"}]
    mid = prompt_tokens([*later, {"role": "system", "content": LONG_SYSTEM}, question])
    assert mid > prompt_tokens([*later, question]) + 200
    # Anthropic's top-level system, counted without generating.
    resp = c.post(
        "/v1/messages/count_tokens",
        json={"model": "g", "system": LONG_SYSTEM, "messages": [question]},
    )
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json()["input_tokens"] > alone + 200


def test_the_generic_tool_format_reaches_a_model_that_drops_system_messages(
    gguf: Callable[[str, str | None], Path],
) -> None:
    """A template without tools gets them described in a system message: on a handler that
    drops system messages (``gemma``) that description is folded like any other."""
    rt = LlamaRuntime()
    rt.load(
        ModelSpec(path=str(gguf("bare", None)), n_ctx=4096, parallel=1, chat_format="gemma"), "cpu"
    )
    try:
        tool = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
        plain = {"messages": [CONVERSATION[2]]}
        bare = rt.count_tokens(plain)["input_tokens"]
        with_tools = rt.count_tokens({**plain, "tools": [tool], "tool_choice": "auto"})
        # The description names the tool and its schema: far more than the question alone.
        assert with_tools["input_tokens"] > bare + 100
    finally:
        rt.close()
