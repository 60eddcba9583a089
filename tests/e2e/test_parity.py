"""Greedy tokens through `pdserve up` (2 prefill + 2 decode processes) equal transformers' generate, every
family (the prompts and helpers: parity_cases.py; chunked and packed: test_parity_chunks.py; on a mesh:
test_parity_mesh.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from pdserve.server.client import build_request, stream
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free
from tests.e2e.parity_cases import FAMILIES, PROMPTS, generate_ids, hf_greedy


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


def test_bf16_checkpoint_serves_end_to_end(tiny_model, tmp_path):
    model_dir = tiny_model("qwen3", "bfloat16")
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1) as state:
        msgs = list(stream(state["coordinator"], build_request(prompt="def main():", max_tokens=8, temperature=0.0,
                                                               ignore_eos=True), timeout=120))
        assert sum(len(m.token_ids) for m in msgs) == 8
        assert msgs[-1].finish_reason == 2  # length
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs
