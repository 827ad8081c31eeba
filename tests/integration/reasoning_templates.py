"""Chat templates in the shapes reasoning models and Qwen3-Coder ship, for tiny test models that
must look like one to the runtime: ChatML whose text mentions ``<think>`` (DeepSeek-R1, QwQ),
one whose generation prompt ends inside an open block unless ``enable_thinking`` is false
(Qwen3's thinking models, R1's distills), and one that takes tools in Qwen3-Coder's XML."""

from __future__ import annotations

#: The control tokens a "thinking" tiny model's vocabulary gets (as real ones have them).
THINK_TOKENS = ("<think>", "</think>")

_TURNS = (
    "{%- for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}"
)

#: ChatML; the model writes its reasoning in <think> tags (said in a comment, which is all
#: the runtime reads), and earlier turns are rendered as given.
THINK_TEMPLATE = (
    "{#- The model reasons in <think> ... </think> first. #}"
    + _TURNS
    + ("{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
)

#: Qwen3's generation prompt: inside an open <think> block, or an empty closed one when the
#: request turns thinking off.
OPEN_TEMPLATE = _TURNS + (
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}"
    "{%- endif %}"
)

#: Qwen3-Coder's tool format: the tools listed, calls written back as XML.
QWEN3_CODER_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n"
    "{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in message.tool_calls %}<tool_call>\n<function={{ tc.function.name }}>\n"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
