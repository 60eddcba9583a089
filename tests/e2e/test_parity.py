"""Greedy tokens through `pdserve up` (2 prefill + 2 decode processes) equal transformers' generate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tokenizers import Tokenizer

from pdserve.server.client import build_request, stream
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free

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
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def generate_ids(addr: str, prompt: str) -> tuple[list[int], int]:
    ids: list[int] = []
    reason = 0
    for msg in stream(addr, build_request(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0), timeout=120):
        ids.extend(msg.token_ids)
        reason = msg.finish_reason or reason
    return ids, reason


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2-defaults"])  # + a Gemma 2 whose config.json omits its caps
def test_greedy_equals_transformers(family, tiny_model, tmp_path):
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    assert len({len(tok.encode(p).ids) for p in PROMPTS}) >= 6, "prompts must differ in length"
    with pdserve_up(model_dir, tmp_path) as state:
        addr = state["coordinator"]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: generate_ids(addr, p), PROMPTS))
        for prompt, want, (ids, reason) in zip(PROMPTS, expected, got):
            assert ids == want, f"{family}: prompt {prompt!r}"
            assert reason in (1, 2)
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


LONG_PROMPTS = [
    "def f(x):\n    return x * 2\n" * 9,  # several 64-token chunks
    "import numpy as np\nimport torch\n" * 5,
]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_with_small_chunks_and_packed_steps(family, tiny_model, tmp_path):
    """Prompts of mixed lengths at once through one prefill worker that packs them into 128-token steps
    and runs anything longer than 64 tokens chunk by chunk, interleaved with the short ones; its decode worker
    speculates (n-gram, issue 30: greedy streams with speculation on equal transformers', and so speculation
    off's — test_greedy_equals_transformers above — on every family; the prompts repeat, so proposals are
    verified and accepted; that they are, and counted, the decode worker test of test_spec_decode.py checks)."""
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = PROMPTS + LONG_PROMPTS
    assert max(len(tok.encode(p).ids) for p in prompts) > 2 * 64, "a prompt must take several chunks"
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in prompts]
    args = ["--max-prefill-chunk", "64", "--max-num-batched-tokens", "128", "--speculative-config", SPEC]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1, extra_args=args) as state:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: generate_ids(state["coordinator"], p), prompts))
        for prompt, want, (ids, _) in zip(prompts, expected, got):
            assert ids == want, f"{family}: prompt {prompt!r}"
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def test_bf16_checkpoint_serves_end_to_end(tiny_model, tmp_path):
    model_dir = tiny_model("qwen3", "bfloat16")
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1) as state:
        msgs = list(stream(state["coordinator"], build_request(prompt="def main():", max_tokens=8, temperature=0.0,
                                                               ignore_eos=True), timeout=120))
        assert sum(len(m.token_ids) for m in msgs) == 8
        assert msgs[-1].finish_reason == 2  # length
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_greedy_equals_transformers_with_prefill_on_a_two_device_mesh(family, tiny_model, tmp_path):
    """`pdserve up --tensor-parallel-size 2` on 2 forced host devices: the prefill worker shards kv heads
    and MLP (an MoE's experts) over both (decode workers run on one device), greedy tokens unchanged."""
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1, extra_args=["--tensor-parallel-size", "2"],
                    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}) as state:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: generate_ids(state["coordinator"], p), PROMPTS))
        assert [ids for ids, _ in got] == expected
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def test_a_mesh_the_model_cannot_split_is_refused_at_start(tiny_model, tmp_path):
    """3 devices cannot each hold whole kv heads of a model with 2: the worker refuses, naming the fix."""
    with pytest.raises(RuntimeError, match=r"tensor parallelism 3 must divide the model's num_kv_heads \(2\).*"
                                           r"--tensor-parallel-size 1 or 2"):
        with pdserve_up(tiny_model("qwen3"), tmp_path, prefill_workers=1, decode_workers=1, timeout=120,
                        extra_args=["--tensor-parallel-size", "3"],
                        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}):
            pass
