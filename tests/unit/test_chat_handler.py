"""Which chat handler a model is served with (``workers.chat_handler``): the GGUF's own
template over a built-in format that ``chat_format`` names."""

from __future__ import annotations

from workers.chat_handler import GGUF_TEMPLATE, preferred

FORMATS = {"gemma", "chatml", "llama-2", "chatml-function-calling", "functionary-v2"}
WITH = {GGUF_TEMPLATE: "{{ messages }}", "chat_template.tool_use": "{{ tools }}"}


def test_a_gguf_template_wins_over_a_built_in_format() -> None:
    assert preferred("gemma", WITH, FORMATS) == GGUF_TEMPLATE
    assert preferred("chatml", WITH, FORMATS) == GGUF_TEMPLATE


def test_without_a_gguf_template_the_named_format_is_used() -> None:
    assert preferred("gemma", {}, FORMATS) == "gemma"
    # A named template other than the default is not the GGUF's own chat template.
    assert preferred("gemma", {"chat_template.tool_use": "x"}, FORMATS) == "gemma"


def test_function_calling_handlers_and_template_names_are_kept_as_named() -> None:
    assert preferred("chatml-function-calling", WITH, FORMATS) == "chatml-function-calling"
    assert preferred("functionary-v2", WITH, FORMATS) == "functionary-v2"
    assert preferred("chat_template.tool_use", WITH, FORMATS) == "chat_template.tool_use"


def test_unset_stays_unset() -> None:
    assert preferred(None, WITH, FORMATS) is None
