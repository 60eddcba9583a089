"""The decode worker's load report names the LoRA adapters it holds (`WorkerLoad.device_loras`, `host_loras`, least
recently used first), what the coordinator routes an adapter's requests by (coordinator/lora_routing.py)."""

from __future__ import annotations

import torch

from pdserve.server.decode.lora import LoraSlots
from pdserve.server.model.config import load_config
from tests.decode.test_lora_engine import _engine, _keys, _run


def _names(adapters) -> list[str]:
    return [a.name for a in adapters]


async def test_the_load_report_names_the_adapters_in_device_slots_and_host_memory(tiny_loras):
    base, loras = tiny_loras
    keys = _keys(loras)
    engine = _engine(base, max_loras=1, max_cpu_loras=2)
    load = engine.load()
    assert (_names(load.device_loras), _names(load.host_loras)) == ([], [])
    await _run(engine, "a", [5, 6, 7, 8, 9], 3, keys["ada"])
    await _run(engine, "b", [5, 6, 7, 8, 9], 3, keys["bob"])  # takes ada's one device slot
    load = engine.load()
    assert (_names(load.device_loras), _names(load.host_loras)) == (["bob"], ["ada", "bob"])
    assert [(a.id, a.path) for a in load.device_loras] == [(keys["bob"].id, keys["bob"].path)]
    await _run(engine, "c", [5, 6, 7, 8, 9], 3, keys["cy"])  # evicts ada from host memory (--max-cpu-loras 2)
    load = engine.load()
    assert (_names(load.device_loras), _names(load.host_loras)) == (["cy"], ["bob", "cy"])
    await engine.close()
    plain = LoraSlots(load_config(base), 2, 2, 16, torch.float32, torch.device("cpu"))
    assert plain.held() == ([], [])
