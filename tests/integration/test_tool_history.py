"""A conversation's earlier tool calls as its model's template writes them: a template that
passes a call's arguments through ``tojson`` (Llama 3.1's, gpt-oss's) gets them as the object
they hold, not as the JSON string OpenAI clients send back (real llama.cpp, tiny models)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from residency.settings import ModelSpec
from residency.tinymodel import write_tiny_model
from tests.integration.tools_template import TOOLS_TEMPLATE
from workers import chat_tools
from workers.runtime import LlamaRuntime

#: Llama 3.1's way with a call in history: ``{"name": …, "parameters": args | tojson}``.
TOJSON_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.tool_calls %}{% for tc in message.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def history(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def loaded(path: Path, template: str) -> LlamaRuntime:
    if not path.exists():
        write_tiny_model(path, seed=8, chat_template=template)
    rt = LlamaRuntime()
    rt.load(ModelSpec(path=str(path), n_ctx=512, parallel=1), "cpu")
    return rt


def test_a_template_that_json_encodes_arguments_gets_them_as_objects(models_dir: Path) -> None:
    rt = loaded(models_dir / "tiny-tojson.gguf", TOJSON_TEMPLATE)
    try:
        as_string = rt.count_tokens({"messages": history('{"city": "Oslo"}')})
        as_object = rt.count_tokens({"messages": history({"city": "Oslo"})})
        # The same prompt either way: the string was given to the template as its object.
        assert as_string == as_object
    finally:
        rt.close()


def test_a_template_that_writes_arguments_as_they_come_keeps_the_string(
    models_dir: Path,
) -> None:
    rt = loaded(models_dir / "tiny-tools-history.gguf", TOOLS_TEMPLATE)
    try:
        assert not rt._object_arguments
        prompt = rt.render(history('{"city": "Oslo"}'))
        assert prompt is not None and '"arguments": {"city": "Oslo"}' in prompt
    finally:
        rt.close()


def test_only_json_object_arguments_become_objects() -> None:
    msgs = history('{"city": "Oslo"}') + history("not json") + history("[1, 2]")
    out = chat_tools.object_arguments(msgs)
    args = [m["tool_calls"][0]["function"]["arguments"] for m in out if m.get("tool_calls")]
    assert args == [{"city": "Oslo"}, "not json", "[1, 2]"]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'  # a copy
    assert chat_tools.encodes_arguments('{"parameters": "{\\"probekey\\": 1}"}')
    assert not chat_tools.encodes_arguments('{"parameters": {"probekey": 1}}')
    assert not chat_tools.encodes_arguments(None)
