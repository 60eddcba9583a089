"""LoRA on the decode worker's /metrics, as vLLM 0.32 exports it: vllm:lora_requests_info (a gauge whose value is
the time read and whose labels name max_lora and the running and waiting adapters), pdserve_lora_requests_total
per adapter, pdserve_lora_load_seconds; and each adapter load logged with its milliseconds."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import torch
from prometheus_client import REGISTRY, generate_latest

from pdserve.server import metrics
from pdserve.server.decode.lora import LoraSlots, adapters_in_flight
from pdserve.server.model.config import load_config
from tests.decode.test_lora_engine import PROMPTS, _engine, _keys, _request


def _lora_info() -> list[tuple[dict[str, str], float]]:
    """The vllm:lora_requests_info samples as /metrics writes them: (labels, value)."""
    text = generate_latest(REGISTRY).decode()
    out = []
    for line in text.splitlines():
        m = re.fullmatch(r'vllm:lora_requests_info\{(.*)\} (\S+)', line)
        if m:
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m[1])), float(m[2])))
    if out:
        assert "# TYPE vllm:lora_requests_info gauge" in text
        assert "# HELP vllm:lora_requests_info Running stats on lora requests." in text
    return out


def _count(name: str) -> float:
    return REGISTRY.get_sample_value("pdserve_lora_requests_total", {"model_name": "tiny", "role": "decode",
                                                                     "lora_name": name}) or 0.0


async def test_lora_requests_info_names_the_running_and_waiting_adapters(tiny_loras):
    """Three adapters' requests and a base one on a worker of --max-loras 1: the step takes one adapter's rows, the
    other adapters' sequences wait for a slot. The gauge's labels say which, its value is the time read; the
    per-adapter counter counts each adapter's requests once."""
    base, loras = tiny_loras
    keys = _keys(loras)
    metrics.identify("tiny", "decode")
    engine = _engine(base, max_loras=1, max_cpu_loras=3)
    metrics.watch_lora(engine.lora.max_loras, lambda: adapters_in_flight(engine.running, engine.sequences))
    try:
        before = {name: _count(name) for name in keys}
        seqs = [engine.add(_request(name, PROMPTS[name], 40, keys[name])) for name in ("ada", "bob", "cy")]
        seqs.append(engine.add(_request("base", PROMPTS["base"], 40, None)))
        assert {name: _count(name) - before[name] for name in keys} == {"ada": 1, "bob": 1, "cy": 1}
        [(labels, value)] = _lora_info()
        assert labels == {"model_name": "tiny", "role": "decode", "max_lora": "1", "waiting_lora_adapters":
                          "ada,bob,cy", "running_lora_adapters": ""}
        assert abs(value - time.time()) < 5
        for seq in seqs:
            await seq.admitted
            engine.start(seq, await engine.prefill_locally(seq))
        await asyncio.sleep(0)
        running, waiting = adapters_in_flight(engine.running, engine.sequences)
        assert running == ["ada", "bob", "cy"] and waiting == []  # all four decode; each step takes one adapter's
        [(labels, _)] = _lora_info()
        assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("ada,bob,cy", "")
        for seq in seqs:
            while await seq.events.get() is not None:
                pass
        [(labels, _)] = _lora_info()
        assert (labels["running_lora_adapters"], labels["waiting_lora_adapters"]) == ("", "")
    finally:
        metrics._lora_state.clear()
        await engine.close()
    assert _lora_info() == []  # a worker without --enable-lora exports none (vLLM: without a LoRA config)


def test_each_adapter_load_is_logged_with_its_milliseconds_and_timed(tiny_loras, caplog):
    base, loras = tiny_loras
    keys = _keys(loras)
    slots = LoraSlots(load_config(base), 1, 1, 16, torch.float32, torch.device("cpu"))
    seconds = "pdserve_lora_load_seconds_count"
    identity = {"model_name": metrics._identity["model_name"], "role": metrics._identity["role"]}
    loads = REGISTRY.get_sample_value(seconds, identity) or 0.0
    with caplog.at_level(logging.INFO, logger="pdserve.decode"):
        slots.adapter(keys["ada"])
        slots.adapter(keys["ada"])  # from host memory: no load
        slots.adapter(keys["bob"])  # evicts ada (--max-cpu-loras 1)
        slots.adapter(keys["ada"])  # loaded again
    lines = [r.getMessage() for r in caplog.records if "loaded from" in r.getMessage()]
    assert [line.split("'")[1] for line in lines] == ["ada", "bob", "ada"]
    for line in lines:
        assert re.search(r"\(id \d+, rank \d+, [a-z_/]+\) loaded from \S+ in \d+\.\d ms$", line), line
    assert REGISTRY.get_sample_value(seconds, identity) - loads == 3
    assert adapters_in_flight([], {}) == ([], [])
