"""Greedy parity with transformers through a prefill worker that chunks and packs, its decode worker speculating."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from tests.e2e.cluster import pdserve_up, wait_all_blocks_free
from tests.e2e.parity_cases import FAMILIES, LONG_PROMPTS, PROMPTS, SPEC, generate_ids, hf_greedy


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
