"""Start-up compiles (warmup.py): what serves any prompt before the worker serves, the rest in the
background while it serves, the most asked for first (only those while steps run); what is compiled
grows as each finishes; the compile cache where a restart finds it.

A fake engine whose compiles can be held checks the order and who compiles what (each program once);
the tiny model checks that prompts served before the background starts compile nothing and get what a
fully compiled engine gives, and that nothing compiles once the background is done."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from prometheus_client import REGISTRY

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill import main
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.step_packing import StepShape
from pdserve.server.prefill.model import load_params
from pdserve.server.prefill.rates import PrefillRates
from pdserve.server.prefill.warmup import Warmup
from tests.prefill.test_compiles import compiles


class FakeEngine:
    """What Warmup reads of an engine (its runner's compiles are its own here); each compile is
    recorded (key, thread) and waits while its key is held."""

    def __init__(self, shapes: list[StepShape], max_batch_size: int = 2, lengths: tuple[int, ...] = (16, 32)):
        self.config = PrefillConfig(model_dir=Path("unused"), max_batch_size=max_batch_size)
        self.rates = PrefillRates(list(lengths))
        self._shapes = shapes
        self.calls: list[tuple[object, str]] = []
        self.held: dict[object, threading.Event] = {}
        self.entered: dict[object, threading.Event] = {}
        self.failing: set[object] = set()
        self.runner = self

    def shapes(self) -> list[StepShape]:
        return self._shapes

    def hold(self, key) -> threading.Event:
        self.entered[key] = threading.Event()
        self.held[key] = threading.Event()
        return self.held[key]

    def _compile(self, key, result=None):
        self.calls.append((key, threading.current_thread().name))
        if key in self.entered:
            self.entered[key].set()
            assert self.held[key].wait(10)
        if key in self.failing:
            raise RuntimeError(f"compiling {key} failed")
        return result

    def compile_step(self, shape):
        return self._compile(shape, [f"logits[{r}]" for r in (1, 2)])

    def compile_sample(self, logits):
        return self._compile(("sample", logits))

    def compile_penalized(self, logits, length):
        return self._compile(("penalized", logits, length))


SHAPES = [StepShape(64, 256), StepShape(16, 256), StepShape(64, 0), StepShape(16, 0)]


def test_jobs_come_most_likely_first_and_common_is_what_serves_any_prompt():
    warmup = Warmup(FakeEngine(SHAPES))
    assert [j.key for j in warmup.jobs] == [
        StepShape(16, 0), StepShape(64, 0), StepShape(16, 256), StepShape(64, 256),
        ("sample", 1), ("sample", 2),
        ("penalized", 1, 16), ("penalized", 2, 16), ("penalized", 1, 32), ("penalized", 2, 32)]
    # every shape without context, the largest context's with the most token slots up to CONTEXT_CHUNK,
    # sampling at each row count, penalized sampling at the most rows and the longest prompts
    assert [j.key for j in warmup.first("common")] == [StepShape(16, 0), StepShape(64, 0), StepShape(64, 256),
                                                       ("sample", 1), ("sample", 2), ("penalized", 2, 32)]
    assert warmup.first("all") == warmup.jobs
    past_the_chunk = [StepShape(1024, 512), StepShape(512, 512), StepShape(256, 512), StepShape(1024, 0)]
    assert [j.key for j in Warmup(FakeEngine(past_the_chunk)).first("common")][:2] == [StepShape(1024, 0),
                                                                                        StepShape(512, 512)]
    no_context = Warmup(FakeEngine([StepShape(16, 0), StepShape(32, 0)]))
    assert [j.key for j in no_context.first("common") if isinstance(j.key, StepShape)] == [StepShape(16, 0),
                                                                                            StepShape(32, 0)]


def _first_set(engine: FakeEngine) -> Warmup:
    warmup = Warmup(engine)
    warmup.compile(warmup.first("common"), threads=2)
    return warmup


def test_what_is_compiled_grows_as_jobs_finish_and_the_background_takes_the_most_asked_first():
    engine = FakeEngine(SHAPES)
    warmup = _first_set(engine)
    assert {k for k, _ in engine.calls if isinstance(k, StepShape)} == {StepShape(16, 0), StepShape(64, 0),
                                                                        StepShape(64, 256)}
    assert sorted(k for k, _ in engine.calls if not isinstance(k, StepShape)) == [  # the first shape's head's logits
        ("penalized", "logits[2]", 32), ("sample", "logits[1]"), ("sample", "logits[2]")]
    assert warmup.compiled.steps == {StepShape(16, 0), StepShape(64, 0), StepShape(64, 256)}
    assert warmup.compiled.penalized == {(2, 32)}
    assert warmup.pending == 4 and warmup.done == 6 and not warmup.finished.is_set()

    warmup.ask(("penalized", 1, 16), StepShape(16, 256), StepShape(64, 0))  # (64, 0): compiled, not counted
    warmup.ask(("penalized", 1, 16), ("no", "such job"))
    assert warmup.asked == {("penalized", 1, 16): 2, StepShape(16, 256): 1}
    warmup.start(threads=1)
    assert warmup.finished.wait(10) and warmup.pending == 0
    background = [k for k, t in engine.calls if t == "compile-background-0"]
    assert background == [("penalized", "logits[1]", 16), StepShape(16, 256), ("penalized", "logits[2]", 16),
                          ("penalized", "logits[1]", 32)]  # the most asked, then the jobs' order
    assert warmup.compiled.steps == set(SHAPES)
    assert warmup.compiled.penalized == {(1, 16), (2, 16), (1, 32), (2, 32)}
    assert len(engine.calls) == len(warmup.jobs) == 10  # every program once


def test_a_failed_background_compile_is_logged_and_never_joins_the_compiled_shapes(caplog):
    engine = FakeEngine(SHAPES)
    engine.failing.add(StepShape(16, 256))
    warmup = _first_set(engine)
    warmup.start()
    assert warmup.finished.wait(10)
    assert "compiling StepShape(tokens=16, context=256) failed; no step runs it" in caplog.text
    assert StepShape(16, 256) not in warmup.compiled.steps and warmup.compiled.step_shape(16, 100) == StepShape(64, 256)
    assert len(engine.calls) == 10
    with pytest.raises(RuntimeError, match="failed"):  # before serving, a failure stops the start
        failing = Warmup(engine)
        failing.compile(failing.jobs, threads=1)


def test_while_steps_run_the_background_takes_only_what_the_traffic_asked_for():
    engine = FakeEngine(SHAPES)
    warmup = _first_set(engine)
    warmup.pause()  # the engine took a step
    warmup.start()
    time.sleep(0.3)
    assert len(engine.calls) == 6 and warmup.pending == 4
    warmup.ask(StepShape(16, 256))  # a step would have run it
    deadline = time.monotonic() + 10
    while StepShape(16, 256) not in warmup.compiled.steps and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert [k for k, _ in engine.calls[6:]] == [StepShape(16, 256)] and warmup.pending == 3
    warmup.resume()  # the queue is empty
    assert warmup.finished.wait(10) and len(engine.calls) == 10


def test_stop_ends_the_background_after_the_compile_in_flight():
    engine = FakeEngine(SHAPES)
    warmup = _first_set(engine)
    release = engine.hold(StepShape(16, 256))
    warmup.start()
    assert engine.entered[StepShape(16, 256)].wait(10)
    stopping = threading.Thread(target=warmup.stop)
    stopping.start()
    while not warmup._stopping:  # stopping, now joining the background
        time.sleep(0.01)
    release.set()
    stopping.join(10)
    assert not stopping.is_alive() and warmup.pending == 3 and not warmup.finished.is_set()


def _sampling(i: int) -> gen_pb.SamplingParams:
    """Greedy, penalties, min_tokens, seeded sampling, in turn."""
    options = [dict(temperature=0.0), dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
               dict(temperature=0.0, min_tokens=3), dict(temperature=0.8, top_k=5, seed=7)]
    return gen_pb.SamplingParams(max_tokens=4, **options[i % len(options)])


LENGTHS = [100, 7, 40, 128, 20, 65]
"""Over the 32-token chunk: later chunks run with context; the 128-token prompt repeats the 100-token one's prefix."""


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, n).tolist() for n in LENGTHS]
    prompts[3][:100] = prompts[0]
    return prompts


async def _serve(engine: PrefillEngine):
    first = await asyncio.gather(*(engine.submit(p, _sampling(i), 0, "float32") for i, p in enumerate(_prompts()[:3])))
    rest = [await engine.submit(p, _sampling(i), 0, "bfloat16") for i, p in enumerate(_prompts()[3:])]
    return first + rest


def _gauge(name: str = "pdserve_prefill_compiles_pending") -> float:
    return REGISTRY.get_sample_value(name, {"model_name": "m", "role": "prefill"})


def _compile_waits() -> float:
    """pdserve_prefill_compile_waits_total, whatever model and role the process named itself."""
    return sum(s.value for m in REGISTRY.collect() if m.name == "pdserve_prefill_compile_waits"
               for s in m.samples if s.name.endswith("_total"))


async def test_prompts_served_while_the_rest_compiles_equal_a_fully_compiled_engines(tiny_model):
    path = tiny_model("qwen2")
    model_config = load_config(path)
    params = load_params(model_config, load_weights(path))
    config = PrefillConfig(model_dir=path, max_batch_size=4, max_model_len=128, max_prefill_chunk=32,
                           max_batch_tokens=64, prefill_order="fifo", served_model_name=("m",))  # the same steps
    reference = PrefillEngine(model_config, params, config)
    reference.warmup()
    want = await _serve(reference)

    engine = PrefillEngine(model_config, params, config)
    warmup = Warmup(engine)
    warmup.compile(warmup.first("common"), threads=2)
    rest = warmup.pending
    assert rest == len(warmup.jobs) - len(warmup.first("common")) > 0
    engine.compiling = warmup
    worker = await main.start(config, engine=engine)
    try:
        assert _gauge() == rest
        assert _gauge("pdserve_prefill_programs_total") == len(warmup.jobs)
        assert _gauge("pdserve_prefill_programs_compiled") == len(warmup.jobs) - rest
        waits, before = _compile_waits(), compiles()
        got = await _serve(engine)  # before the background starts: every step packs into the first set
        assert compiles() == before and _compile_waits() == waits
        assert engine._shapes_run <= warmup.compiled.steps and warmup.pending == rest
        assert warmup.asked and all(warmup._by_key[k].state == "waiting" for k in warmup.asked)  # compiled first
        warmup.start()
        assert [r.first_token for r in got] == [r.first_token for r in want]
        for g, w in zip(got, want, strict=True):  # other chunks, other sums: bf16 KV may round one ulp apart
            assert g.k.dtype == w.k.dtype and g.k.shape == w.k.shape
            rtol = 1e-5 if g.k.dtype == np.float32 else 2**-7
            np.testing.assert_allclose(g.k.astype(np.float32), w.k.astype(np.float32), rtol=rtol, atol=1e-5)
            np.testing.assert_allclose(g.v.astype(np.float32), w.v.astype(np.float32), rtol=rtol, atol=1e-5)
        assert engine.prefix.hits > 0
        await asyncio.to_thread(warmup.finished.wait, 300)
        assert warmup.pending == 0 and _gauge() == 0
        before = compiles()
        again = await _serve(engine)
        assert [r.first_token for r in again] == [r.first_token for r in want]
        assert compiles() == before, f"{compiles() - before} compilations after every program compiled"
    finally:
        await worker.stop()


def test_load_engine_serving_compiles_the_common_set_first_and_the_rest_in_the_background(tiny_model, caplog):
    path = tiny_model("llama")
    config = PrefillConfig(model_dir=path, max_batch_size=2, max_model_len=64)
    caplog.set_level("INFO", logger="pdserve.prefill")
    engine = main.load_engine(config, progress=False, serving=True)
    first = engine.compiling.first("common")
    assert all(j.state == "done" for j in first)
    assert f"{len(first)} of {len(engine.compiling.jobs)} start-up programs" in caplog.text
    assert engine.compiling.finished.wait(300)
    assert "start-up programs compiled" in caplog.text
    full = main.load_engine(PrefillConfig(model_dir=path, max_batch_size=2, max_model_len=64,
                                          compile_before_serving="all"), progress=False, serving=True)
    assert full.compiling.finished.is_set()  # everything before it serves: nothing left for the background
    assert main.load_engine(config, progress=False).compiling.finished.is_set()  # not serving: all of it


def test_compilation_cache_is_the_machines_unless_jax_is_told_or_it_is_off(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    told = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert main.compilation_cache_dir("auto") == tmp_path / "jax-compilation-cache"
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")  # $JAX_COMPILATION_CACHE_DIR
        assert main.compilation_cache_dir("auto") == Path("/elsewhere")
    finally:
        jax.config.update("jax_compilation_cache_dir", told)
    assert main.compilation_cache_dir("none") is None
    assert main.compilation_cache_dir(tmp_path / "mine") == tmp_path / "mine"
    assert PrefillConfig(model_dir=tmp_path).compilation_cache == "auto"
    with pytest.raises(ValueError, match="--compile-before-serving must be one of common, all"):
        PrefillConfig(model_dir=tmp_path, compile_before_serving="some")  # type: ignore[arg-type]


RESTART = """
import json, sys
import jax, jax.monitoring
from pathlib import Path
from pdserve.server import cli
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.main import load_engine

events = []
jax.monitoring.register_event_listener(lambda e, **kw: events.append(e))
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events.append(e))
args = cli.build_parser().parse_args(["prefill", "--model", sys.argv[1], "--compile-cache-dir", sys.argv[2],
                                      "--max-batch-size", "1", "--max-model-len", "32", "--prefix-cache-bytes", "0",
                                      *sys.argv[3:]])
config = cli._config(PrefillConfig, args, model_dir=Path(sys.argv[1]))
engine = load_engine(config, progress=False, serving=True)  # the first set, then the rest in the background
assert engine.compiling.finished.wait(600)
print(json.dumps({"asked": events.count("/jax/compilation_cache/compile_requests_use_cache"),
                  "hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "programs": len(engine.compiling.jobs), "cache": str(jax.config.jax_compilation_cache_dir),
                  "executables": [executables.hits, executables.misses] if (executables := engine.runner.executables)
                  else None}))
"""


def test_a_worker_restarted_on_the_same_compile_cache_dir_compiles_nothing(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.update(PDSERVE_CACHE=str(tmp_path / "machine"), JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    shared = tmp_path / "shared-volume" / "jax"  # --compile-cache-dir: one directory for every worker
    runs = []
    for flags in ([], ["--no-executable-cache"], []):  # cold; JAX's cache alone; JAX's and the executable cache
        proc = subprocess.run([sys.executable, "-c", RESTART, str(tiny_model("llama")), str(shared), *flags], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm, loaded = runs
    assert cold["cache"] == warm["cache"] == loaded["cache"] == str(shared)
    assert cold["asked"] > 0 and cold["hits"] == 0 and cold["misses"] == cold["asked"]
    assert warm["hits"] == warm["asked"] == cold["asked"]  # every program, however small and quick
    assert warm["misses"] == 0  # the restart compiles nothing new (XLA compiles only on a miss)
    assert cold["programs"] == warm["programs"] == loaded["programs"] > 0
    executables = cold["executables"][1]  # (server/prefill/executables.py) each compiled program's, stored
    assert cold["executables"] == [0, executables] and executables >= cold["programs"] and warm["executables"] is None
    assert loaded["executables"] == [executables, 0]  # a restart loads every one: JAX is asked only for the rest
    assert loaded["misses"] == 0 and loaded["hits"] == loaded["asked"] == cold["asked"] - executables
    assert any(shared.iterdir()) and not (tmp_path / "machine").exists()
