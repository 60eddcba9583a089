"""The prompts, families and helpers of the greedy-parity tests (test_parity*.py) and of the e2e tests that
compare against transformers the same way."""

from __future__ import annotations

from pdserve.server.client import build_request, stream
from tests.hf_oracle import hf_greedy_tokens

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
"""n-gram speculation as the e2e tests turn it on (the counters' own test: tests/e2e/test_spec_decode.py)."""
PROMPTS = [
    "def",
    "import os\n",
    "class Foo(object):\n    def __init__(self):",
    "for i in range(10):\n    print(i)\n",
    "# Copyright 2001 Python Software Foundation\n",
    "return self._value if self._value is not None else default_value",
    'if __name__ == "__main__":\n    main()\n' * 3,
    "x = [1, 2, 3]\n" * 12,
]
MAX_TOKENS = 12
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mistral-windowed", "gemma2", "gemma3", "mixtral", "qwen3_moe"]
"""Every served family's tiny checkpoint (server/model/tiny.py): the windowed ones' window is 24 tokens, shorter
than most prompts here; the MoEs pick 2 of 8 experts."""


def hf_greedy(model_dir, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy answer: MAX_TOKENS tokens, fewer when it ends at an end-of-sequence token."""
    return hf_greedy_tokens(model_dir, prompt_ids, MAX_TOKENS, stop_at_eos=True)


def generate_ids(addr: str, prompt: str) -> tuple[list[int], int]:
    ids: list[int] = []
    reason = 0
    for msg in stream(addr, build_request(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0), timeout=120):
        ids.extend(msg.token_ids)
        reason = msg.finish_reason or reason
    return ids, reason


LONG_PROMPTS = [
    "def f(x):\n    return x * 2\n" * 9,  # several 64-token chunks
    "import numpy as np\nimport torch\n" * 5,
]
