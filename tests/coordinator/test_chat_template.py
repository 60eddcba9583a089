"""The chat template renders exactly as `transformers`' apply_chat_template, over the features real
templates use: tojson with arguments, raise_exception, tools, the generation prompt, loop controls,
{% generation %}, namespaces, roles beyond the usual, reasoning fields, chat_template_kwargs."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HfTokenizer

from pdserve.server.coordinator.chat_template import ChatTemplate, ChatTemplateError

LLAMA31_TOOLS = (  # Llama 3.1's shape: tools as indented JSON in a system header
    "{{- bos_token }}{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou may call:\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN25_TOOLS = (  # Qwen 2.5's shape: compact tojson, a namespace, tool calls and tool responses
    "{%- if tools %}<|im_start|>system\\n# Tools\\n<tools>{%- for tool in tools %}\\n{{ tool | tojson }}{%- endfor %}"
    "\\n</tools><|im_end|>\\n{%- endif %}{%- set ns = namespace(n=0) %}"
    "{%- for message in messages %}{%- set ns.n = ns.n + 1 %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\\n<tool_response>\\n{{ message.content }}\\n</tool_response>"
    "<|im_end|>\\n{%- elif message.tool_calls %}<|im_start|>assistant\\n{%- for c in message.tool_calls %}"
    "<tool_call>\\n{{ c.function | tojson(separators=(',', ':'), sort_keys=true) }}\\n</tool_call>{%- endfor %}"
    "<|im_end|>\\n{%- else %}<|im_start|>{{ message.role }}\\n{{ message.content }}<|im_end|>\\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\\n{%- endif %}{{ '' if ns.n else 'x' }}"
)
MISTRAL_ALTERNATION = (  # Mistral's shape: raise_exception on roles out of turn, loop controls
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}{%- endif %}"
    "{%- if loop.index >= 6 %}{% break %}{%- endif %}{%- endfor %}"
)
QWEN3_THINKING = (  # Qwen 3's shape: enable_thinking from chat_template_kwargs, reasoning_content
    "{%- for message in messages %}<|im_start|>{{ message.role }}\\n"
    "{%- if message.reasoning_content %}<think>\\n{{ message.reasoning_content }}\\n</think>\\n\\n{%- endif %}"
    "{{ message.content }}<|im_end|>\\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\\n\\n</think>\\n\\n{%- endif %}"
    "{%- endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, in °C",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Weather in Zürich?  "}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"celsius\": 3}"},
    {"role": "ipython", "content": "a role beyond the usual five"},
]


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def ours(model_dir, template: str) -> ChatTemplate:
    chat = ChatTemplate.from_dir(model_dir, HfTokenizer.from_file(str(model_dir / "tokenizer.json")), template)
    assert chat is not None
    return chat


@pytest.mark.parametrize("template, messages, tools, kwargs", [
    (LLAMA31_TOOLS, CHAT, TOOLS, {}),
    (LLAMA31_TOOLS, CHAT, None, {}),
    (QWEN25_TOOLS, TOOL_CHAT, TOOLS, {}),
    (MISTRAL_ALTERNATION, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 4, None, {}),
    (QWEN3_THINKING, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo",
                                                         "reasoning": "they greet"}], None, {"enable_thinking": False}),
    (QWEN3_THINKING, [{"role": "user", "content": "hi"}], None, {}),
], ids=["llama31-tools", "llama31", "qwen25-tools", "mistral", "qwen3-no-thinking", "qwen3"])
def test_renders_exactly_as_transformers(model_dir, hf_tokenizer, template, messages, tools, kwargs):
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                                add_generation_prompt=True, **kwargs)
    got = ours(model_dir, template).render(messages, template_kwargs=kwargs, tools=tools)
    assert got == expected


def test_raise_exception_says_what_the_template_says(model_dir, hf_tokenizer):
    import jinja2

    messages = [{"role": "assistant", "content": "b"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate") as theirs:
        hf_tokenizer.apply_chat_template(messages, chat_template=MISTRAL_ALTERNATION, tokenize=False)
    with pytest.raises(ChatTemplateError) as e:
        ours(model_dir, MISTRAL_ALTERNATION).render(messages)
    assert str(e.value) == str(theirs.value)
