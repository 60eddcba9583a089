"""benchmarks/gpu/prefill.py end to end on CPU (--dry-run): a tiny model at tiny lengths, its random
params in load_params' layout, every row measured and written."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.benchmarks.gpu import prefill as gpu_prefill
from pdserve.benchmarks.engine.prefill import prefill_flops


def test_dry_run_measures_every_length(tmp_path):
    result = gpu_prefill.run(tmp_path, dry_run=True, lengths=(16, 32), reps=1, progress=False)
    assert [r["tokens"] for r in result["rows"]] == [16, 32]
    # token buckets 16, 32; no context bucket: prompts fit one step and prefix reuse is off (the prompt repeats)
    assert result["shapes_compiled"] == 2 and result["dry_run"]
    for row in result["rows"]:
        assert len(row["ttft_s"]) == 1 and row["prefill_tflops"] > 0 and row["matmul_tflops"] > 0
        assert row["mfu_vs_matmul"] == row["prefill_tflops"] / row["matmul_tflops"]
    assert json.loads((tmp_path / "gpu_prefill.json").read_text())["rows"] == result["rows"]
    assert "| 32 |" in (tmp_path / "gpu_prefill.md").read_text()


def test_prefill_flops_of_the_qwen25_05b_shape():
    """2 x 512 x 24 layers x 14,909,440 weights + causal attention 2 x 512^2 x 14 x 64 x 24 + lm_head row."""
    from pdserve.benchmarks.checkpoint import QWEN25_05B
    from pdserve.server.model.config import parse_config

    config = parse_config({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **QWEN25_05B}, Path("."))
    assert prefill_flops(config, 512) == 366_414_397_440 + 11_274_289_152 + 272_269_312
