"""DeepSeek-V2/V3 through `pdserve up` as a user runs it: the JAX prefill tier does not compute MLA yet, so up
starts no prefill workers for it (saying so), and the decode workers prefill their own prompts; their greedy
tokens are transformers'."""

from __future__ import annotations

import pytest

from ..decode.test_engine import _hf_greedy
from .procs import generate, request

PROMPTS = [[5, 17, 99, 3, 250, 11, 42, 7, 8, 300, 301, 2, 9], list(range(100, 131))]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_pdserve_up_serves_deepseek_greedy_as_transformers(tiny_model, tmp_path, family):
    from .cluster import pdserve_up

    path = tiny_model(family)
    with pdserve_up(path, tmp_path, prefill_workers=2, decode_workers=2) as addresses:
        assert addresses["prefill"] == [] and len(addresses["decode"]) == 2
        for prompt in PROMPTS:
            assert generate(addresses["coordinator"], request(prompt, 8)) == _hf_greedy(path, prompt, 8)
    assert f"starting 0 prefill workers, not 2: {family}" in (tmp_path / "up.log").read_text()


def test_pdserve_up_serves_an_fp8_deepseek_as_transformers_runs_its_dequantized_twin(tiny_fp8_pair, tmp_path):
    """DeepSeek-V3's own checkpoint format (fp8 e4m3 weights, 128x128 block scales): the decode workers dequantize
    it at load; their greedy tokens are transformers' on the float32 twin (fp8 x scale)."""
    from .cluster import pdserve_up

    fp8, twin = tiny_fp8_pair("deepseek_v3")
    with pdserve_up(fp8, tmp_path, prefill_workers=2, decode_workers=2) as addresses:
        for prompt in PROMPTS:
            assert generate(addresses["coordinator"], request(prompt, 8)) == _hf_greedy(twin, prompt, 8)
