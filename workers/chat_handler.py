"""Which chat handler a model is served with (pure: no llama.cpp).

llama-cpp-python's built-in chat formats (``gemma``, ``chatml``, ``llama-2``...) are fixed
Python formatters written for a model family, and several of them lose what they do not model:
``gemma`` drops every system message, most keep only the first, some replace it with a fixed
preamble, none renders tools. A GGUF's own ``tokenizer.chat_template`` is the model's authors'
rendering of exactly that model (Gemma 3's folds the system message into the first user turn).
So when a GGUF carries a template and ``chat_format`` names one of those built-in formats, the
template wins; ``chat_format`` then only applies to a GGUF without one. A function-calling
handler (``chatml-function-calling``, ``functionary``...) is kept as named: it is chosen for
how it takes tools, not for its rendering, and so is a GGUF template named by its handler name
(``chat_template.<name>``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from workers.chat_tools import FUNCTION_CALLING_FORMATS

#: llama-cpp-python's handler name for the GGUF's ``tokenizer.chat_template``.
GGUF_TEMPLATE = "chat_template.default"


def preferred(
    chat_format: str | None, templates: Mapping[str, str], formats: Collection[str]
) -> str | None:
    """The handler to serve with: the GGUF's template (``GGUF_TEMPLATE``) when it has one
    (``templates``: llama-cpp-python's handler names for the GGUF's templates) and
    ``chat_format`` names one of the built-in ``formats``; ``chat_format`` otherwise (None:
    llama-cpp-python's own choice)."""
    if (
        chat_format in formats
        and chat_format not in FUNCTION_CALLING_FORMATS
        and GGUF_TEMPLATE in templates
    ):
        return GGUF_TEMPLATE
    return chat_format
