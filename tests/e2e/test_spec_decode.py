"""Greedy tokens with n-gram speculative decoding on equal transformers' generate (and so speculation off):
through `pdserve up` (prefill worker + decode worker) on every supported family, and on a decode worker
whose metrics show the speculation ran."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from pdserve.server.client import build_request, stream
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free
from tests.e2e.procs import Procs, counter, generate, request, wait_blocks_free
from tests.e2e.test_parity import hf_greedy

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PROMPTS = [
    "def f(x):\n    return x * 2\n\ndef g(x):\n    return",
    "x = [1, 2, 3]\n" * 6,
    "import os\nimport sys\nimport os\n",
    "for i in range(10):\n    print(i)\n",
]
MAX_TOKENS = 12  # what test_parity.hf_greedy generates


def _ids(addr: str, prompt: str) -> list[int]:
    return [t for m in stream(addr, build_request(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0), timeout=120)
            for t in m.token_ids]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_with_ngram_speculation_through_pdserve_up_equals_transformers(family, tiny_model, tmp_path):
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1,
                    extra_args=["--speculative-config", SPEC]) as state:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _ids(state["coordinator"], p), PROMPTS))
        for prompt, want, ids in zip(PROMPTS, expected, got):
            assert ids == want, f"{family}: prompt {prompt!r}"
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def test_a_speculating_decode_worker_counts_its_drafts_and_gives_transformers_tokens(tiny_model, tmp_path):
    model_dir = tiny_model("llama")
    procs = Procs(model_dir, tmp_path)
    try:
        coordinator = procs.coordinator("coordinator")
        d0 = procs.worker("d0", "decode", coordinator, "--kv-cache-tokens", "4096", "--speculative-config", SPEC)
        prompts = [[3, 14, 15, 92, 65, 35, 89], [7, 8, 9, 7, 8, 9, 7, 8]]
        for prompt in prompts:
            assert generate(coordinator.address, request(prompt, MAX_TOKENS)) == hf_greedy(model_dir, prompt)
        d = d0.metrics()  # pdserve_* samples, without model_name and role
        drafts, proposed = counter(d, "pdserve_spec_decode_num_drafts_total"), counter(d, "pdserve_spec_decode_num_draft_tokens_total")
        accepted = counter(d, "pdserve_spec_decode_num_accepted_tokens_total")
        per_pos = counter(d, "pdserve_spec_decode_num_accepted_tokens_per_pos_total")
        assert drafts > 0 and proposed >= drafts and 0 < accepted <= proposed and per_pos == accepted
        vllm = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in d0.metrics_text().splitlines()
                if line.startswith("vllm:spec_decode")}  # vLLM's names beside them, with model_name
        own = f'model_name="{model_dir.name}",role="decode"'
        assert vllm[f"vllm:spec_decode_num_drafts_total{{{own}}}"] == drafts
        assert vllm[f"vllm:spec_decode_num_accepted_tokens_total{{{own}}}"] == accepted
        per_pos_vllm = {k: v for k, v in vllm.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")}
        assert per_pos_vllm[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model_dir.name}",'
                            f'position="0",role="decode"}}'] > 0
        assert sum(per_pos_vllm.values()) == accepted
        assert wait_blocks_free([d0]) == [(4096 // 16, 4096 // 16)]
    finally:
        procs.stop_all()
