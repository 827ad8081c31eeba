"""A Hermes-style ChatML template that takes ``tools`` (as Qwen and Hermes GGUFs ship one), for
tiny test models that must look tool-capable to llama-cpp-python and to the runtime."""

from __future__ import annotations

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "You may call functions. <tools>"
    "{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in message.tool_calls %}<tool_call>"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
