"""benchmarks.engine.decode_step's reservation part, at a tiny size: the rows it writes and the table."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.benchmarks.engine import decode_step


def test_random_qwen_shape_builds_a_model_that_decodes():
    config, weights = decode_step.random_qwen_shape(layers=1, vocab=64)
    assert (config.num_layers, config.vocab_size, config.hidden_size, config.num_kv_heads) == (1, 64, 896, 2)
    assert config.qkv_bias and config.tie_word_embeddings and "lm_head.weight" not in weights
    model = decode_step.build_model(config, weights)
    cache = decode_step.PagedKvCache(decode_step._layout(config, "int8"), 4)
    times = decode_step.step_seconds(model, cache, torch.tensor([[0, 1], [2, 3]]), context=20, steps=2, warmup=1)
    assert len(times) == 2 and all(t > 0 for t in times)


def test_reservation_part_writes_one_row_per_kv_dtype(tmp_path, capsys):
    args = ["--parts", "reservation", "--reservation-layers", "1", "--reservation-vocab", "64", "--batch", "2",
            "--context", "20", "--reservations", "32", "64", "--steps", "1", "--allow-noisy", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    try:
        assert decode_step.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # main takes one thread, as the worker does
    (run,) = tmp_path.iterdir()
    doc = json.loads((run / "decode_step.json").read_text())
    assert [r["kv"] for r in doc["reservation"]] == ["float32", "int8"]
    for row in doc["reservation"]:
        assert row["ratio"] == pytest.approx(row["ms@64"] / row["ms@32"])
    assert doc["bandwidth"] is None and doc["vs_vllm"] == {}
    assert "| int8 |" in (run / "table.md").read_text() and "64 / 32 (target <= 1.2)" in capsys.readouterr().out
