"""The structured-output benchmark's parts on the tiny model: compile times are measured, and both phases
decode every stream to the token budget (no constrained stream ends early), all in the nested schema."""

from __future__ import annotations

import json

from pdserve.benchmarks.engine.structured import SCHEMA, STREAMS, compile_times, phase
from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.structured.grammars import Grammars


async def test_both_phases_run_every_stream_to_the_budget(tiny_model):
    path = tiny_model("qwen2")
    config = load_config(path)
    eos = tuple(config.eos_token_ids)
    times = compile_times(path, config.vocab_size, eos)
    assert set(times) == {"tokenizer_s", "check_s", "compile_cold_s", "compile_cached_s", "constraint_s"}
    assert all(t > 0 for t in times.values())
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="float32")
    engine = DecodeEngine(build_model(config, load_weights(path)), layout, num_blocks=STREAMS * 4,
                          max_running=STREAMS, eos_ids=frozenset(eos), max_model_len=64,
                          grammars=Grammars.for_model(path, config.vocab_size, eos))
    for constrained in (False, True):
        gaps = await phase(engine, constrained, 6, 0)
        assert len(gaps) >= STREAMS and all(g > 0 for g in gaps)
    assert json.loads(json.dumps(SCHEMA))["properties"]["users"]["minItems"] == 1000
    await engine.close()


def test_mask_cost_is_measured(tiny_model):
    from pdserve.benchmarks.engine.structured import mask_cost

    path = tiny_model("qwen2")
    config = load_config(path)
    cost = mask_cost(Grammars.for_model(path, config.vocab_size, tuple(config.eos_token_ids)), config.vocab_size,
                     steps=3)
    assert set(cost) == {"fill_ms", "apply_ms"} and all(v > 0 for v in cost.values())
