"""The KV handoff of a windowed model through `pdserve up`: the prefill tier sends no KV behind a layer's
window, and the decode worker never lends such incomplete blocks to another prompt from its prefix cache."""

from __future__ import annotations

from tokenizers import Tokenizer

from tests.e2e.cluster import pdserve_up, wait_all_blocks_free
from tests.e2e.parity_cases import generate_ids, hf_greedy

SHARED = "def handler(request, response):\n    status = request.status\n    body = response.body\n" * 2


def test_a_shorter_prompt_sharing_a_long_ones_start_is_not_served_from_its_stale_blocks(tiny_model, tmp_path):
    """A long prompt (4x the window) first, then one sharing its first ~60 tokens but shorter than it: the
    second's window reaches blocks the first's transfer left without windowed KV. Both equal transformers."""
    model_dir = tiny_model("mistral-windowed")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    long = SHARED + "for key, value in sorted(body.items()):\n    print(key, value)\n" * 2
    short = SHARED + "return status"
    n_long, n_short, n_shared = (len(tok.encode(p).ids) for p in (long, short, SHARED))
    assert n_long >= 4 * 24 and n_shared >= 48 and n_short < n_long - 16, (n_long, n_short, n_shared)
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1) as state:
        for prompt in (long, short):
            ids, _ = generate_ids(state["coordinator"], prompt)
            assert ids == hf_greedy(model_dir, tok.encode(prompt).ids), prompt
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs
