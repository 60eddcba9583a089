"""DeepSeek-V2/V3 through `pdserve up` with 2 prefill and 2 decode workers, as a user runs it: the JAX prefill tier
computes each prompt and sends its latent KV (one entry of kv_lora_rank + qk_rope_head_dim values per token and
layer, no V), the decode tier attends to it in the absorbed form; greedy tokens are transformers'."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..decode.test_engine import _hf_greedy
from .procs import generate, request

PROMPTS = [[5, 17, 99, 3, 250, 11, 42, 7, 8, 300, 301, 2, 9], list(range(100, 131))]


def _by_role(port: int, name: str) -> dict[str, float]:
    """The sample `name` summed over the processes of each role ({"prefill": .., "decode": ..}), from `pdserve up
    --metrics-port`'s merged /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and "role" in s.labels:
                totals[s.labels["role"]] = totals.get(s.labels["role"], 0.0) + s.value
    return totals


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_pdserve_up_serves_deepseek_greedy_as_transformers(tiny_model, tmp_path, family):
    """Both prefill workers start; the prefill tier computes every prompt (its prompt-token counter) and the KV
    bytes on the wire per prompt token per layer are the latent's: (32 + 16) values x 4 bytes (fp32), no V."""
    from pdserve.server.launcher import free_port
    from pdserve.server.model.config import load_config

    from .cluster import pdserve_up

    path = tiny_model(family)
    layers = load_config(path).num_layers
    port = free_port("127.0.0.1")
    with pdserve_up(path, tmp_path, prefill_workers=2, decode_workers=2,
                    extra_args=["--metrics-port", str(port), "--max-model-len", "128"]) as addresses:
        assert len(addresses["prefill"]) == 2 and len(addresses["decode"]) == 2
        for prompt in PROMPTS:
            assert generate(addresses["coordinator"], request(prompt, 8)) == _hf_greedy(path, prompt, 8)
        tokens = sum(map(len, PROMPTS))
        assert _by_role(port, "pdserve_prompt_tokens_total").get("prefill") == tokens  # the prefill tier's work
        sent = _by_role(port, "pdserve_kv_transfer_bytes_total")
        assert sent["prefill"] == sent["decode"] == tokens * layers * (32 + 16) * 4
    assert "starting 2 prefill and 2 decode workers" in (tmp_path / "up.log").read_text()


def test_pdserve_up_serves_an_fp8_deepseek_as_transformers_runs_its_dequantized_twin(tiny_fp8_pair, tmp_path):
    """DeepSeek-V3's own checkpoint format (fp8 e4m3 weights, 128x128 block scales): both tiers dequantize it
    at load; their greedy tokens are transformers' on the float32 twin (fp8 x scale)."""
    from .cluster import pdserve_up

    fp8, twin = tiny_fp8_pair("deepseek_v3")
    with pdserve_up(fp8, tmp_path, prefill_workers=1, decode_workers=1,
                    extra_args=["--max-model-len", "128"]) as addresses:
        assert len(addresses["prefill"]) == 1
        for prompt in PROMPTS:
            assert generate(addresses["coordinator"], request(prompt, 8)) == _hf_greedy(twin, prompt, 8)
