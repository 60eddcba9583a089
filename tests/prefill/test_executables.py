"""The executable cache (server/prefill/executables.py): a restarted engine loads every program without tracing and
answers exactly as the engine that compiled them; any change of a key's input misses; an unloadable entry is
logged, removed and compiled again.

Entries come two ways, both checked: from an XLA compile, and copied from JAX's persistent cache when that cache
held the compile (the tests' cache, tests/conftest.py, holds every program once one engine compiled it)."""

from __future__ import annotations

import asyncio
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill import main
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.executables import ExecutableCache, Program
from pdserve.server.prefill.model import load_params
from tests.prefill.test_compiles import _sampling, compiles

LENGTHS = [1, 5, 17, 40, 64, 3, 33, 60]


@pytest.fixture(scope="module")
def llama(tiny_model):
    path = tiny_model("llama")
    model_config = load_config(path)
    return path, model_config, load_params(model_config, load_weights(path))


def _engine(llama, cache: ExecutableCache | None, warm: bool = True) -> PrefillEngine:
    """An engine with every program compiled; with a cache, as in a new process (JAX's in-process caches
    cleared: what they hold has no known origin, and is not written)."""
    path, model_config, params = llama
    if cache is not None:
        jax.clear_caches()
    engine = PrefillEngine(model_config, params, PrefillConfig(model_dir=path, max_batch_size=2, max_model_len=64),
                           executables=cache)
    if warm:
        engine.warmup()
    return engine


async def _serve(engine: PrefillEngine) -> list:
    """Mixed prompts (packed in pairs, sampled, penalized, with logprobs) in both wire dtypes."""
    rng = np.random.default_rng(3)
    return await asyncio.gather(*(engine.submit(rng.integers(3, 500, n).tolist(), _sampling(i), 0,
                                                ("float32", "bfloat16")[i % 2]) for i, n in enumerate(LENGTHS)))


def _same(got: list, want: list) -> None:
    """The same executables on the same inputs: the same tokens, logprobs and KV bytes."""
    assert [r.first_token for r in got] == [r.first_token for r in want]
    assert [r.first_logprob for r in got] == [r.first_logprob for r in want]
    assert [r.prompt_logprobs for r in got] == [r.prompt_logprobs for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.k.dtype == w.k.dtype and g.k.tobytes() == w.k.tobytes() and g.v.tobytes() == w.v.tobytes()


def _entries(cache: ExecutableCache) -> list:
    return sorted(cache.directory.glob("*.exe"))


@pytest.fixture(scope="module")
async def stored(llama, tmp_path_factory) -> tuple[ExecutableCache, PrefillEngine, list]:
    """(the cache an engine filled, that engine, what an engine without the cache answers to `_serve`)."""
    want = await _serve(_engine(llama, None))  # JAX's jit as without the cache; JAX's persistent cache has them now
    cache = ExecutableCache(tmp_path_factory.mktemp("executables"))
    return cache, _engine(llama, cache), want


async def test_a_restart_loads_every_program_untraced_and_answers_as_the_compiled_engine(llama, stored):
    copied, first, want = stored
    programs = copied.misses
    assert programs > len(first.shapes()) and copied.hits == copied.failures == copied.unstored == 0
    assert copied.copied == programs and len(_entries(copied)) == programs  # from JAX's persistent cache's bytes
    _same(await _serve(first), want)

    again = ExecutableCache(copied.directory)
    restarted = _engine(llama, again, warm=False)
    before = compiles()  # (loading the weights runs eager programs)
    restarted.warmup()
    assert (again.hits, again.misses, again.failures) == (programs, 0, 0)
    got = await _serve(restarted)
    assert compiles() == before, f"{compiles() - before} traces or compiles on a restart that loaded every program"
    assert restarted.runner._group.jitted._cache_size() == 0  # every step ran a loaded executable
    _same(got, want)
    assert f"{programs} loaded, 0 compiled ({copied.directory})" == again.summary()


async def test_an_unloadable_entry_is_logged_removed_and_compiled_again(llama, stored, tmp_path, caplog):
    _, _, want = stored
    shutil.copytree(stored[0].directory, tmp_path / "x")
    cache = ExecutableCache(tmp_path / "x")
    entries = _entries(cache)
    entries[0].write_bytes(b"not a pickle")
    entries[1].write_bytes(entries[1].read_bytes()[:100])  # truncated
    caplog.set_level("WARNING", logger="pdserve.prefill")
    _same(await _serve(_engine(llama, cache)), want)
    assert (cache.failures, cache.hits, cache.misses) == (2, len(entries) - 2, 0)
    assert caplog.text.count("does not load") == 2 and "compiling the program again" in caplog.text
    assert str(entries[0]) in caplog.text and str(entries[1]) in caplog.text
    assert all(ExecutableCache(cache.directory).load(e.stem) is not None for e in entries[:2])  # written back


def test_an_entry_of_a_fresh_compile_loads_and_answers_the_same(tmp_path):
    """With JAX's persistent cache off, the program compiles in XLA and is written as compiled."""
    from jax._src import compilation_cache

    def f(x, parts):
        return {"y": jnp.sin(x) @ parts[0] + parts[1].sum(), "n": jnp.argmax(x, axis=-1)}

    args = (np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4), (np.ones((4, 2), np.float32), np.arange(5.0)))
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.clear_caches()
    try:
        fresh = ExecutableCache(tmp_path, environment="env")
        want = Program("f", jax.jit(f), cache=fresh)
        want.compile(*args)
        assert (fresh.misses, fresh.copied, fresh.unstored, len(_entries(fresh))) == (1, 0, 0, 1)
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()
    loaded = ExecutableCache(tmp_path, environment="env")
    got = Program("f", jax.jit(f), cache=loaded)
    got.compile(*args)
    assert loaded.hits == 1 and got.jitted._cache_size() == 0
    out, expected = got(*args), want(*args)
    assert got.jitted._cache_size() == 0  # the call ran the loaded executable
    assert out["y"].tobytes() == expected["y"].tobytes() and out["n"].tolist() == expected["n"].tolist() == [3, 3, 3]


def test_an_executable_of_unknown_origin_is_served_but_not_written(tmp_path):
    """JAX's in-process caches held it: it may have been loaded from the persistent cache, and XLA:CPU writes
    such an executable back without its functions, so no entry is written."""
    jitted = jax.jit(lambda x: x + 1)
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    jitted.lower(spec).compile()
    cache = ExecutableCache(tmp_path, "env")
    program = Program("g", jitted, cache=cache)
    program.compile(spec)
    assert (cache.misses, cache.unstored, _entries(cache)) == (1, 1, [])
    assert program(np.zeros(3, np.float32)).tolist() == [1, 1, 1]


def test_any_changed_input_of_a_key_misses(tmp_path):
    cache = ExecutableCache(tmp_path, environment="env")
    f32, i32 = jax.ShapeDtypeStruct((2, 4), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.int32)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    base = cache.key("head", "config A", (f32, {"w": f32}), {"dtype": "bfloat16"})
    changed = [
        ExecutableCache(tmp_path, "other").key("head", "config A", (f32, {"w": f32}), {"dtype": "bfloat16"}),
        cache.key("embed", "config A", (f32, {"w": f32}), {"dtype": "bfloat16"}),
        cache.key("head", "config B", (f32, {"w": f32}), {"dtype": "bfloat16"}),
        cache.key("head", "config A", (f32, {"w": f32}), {"dtype": "float32"}),
        cache.key("head", "config A", (f32, {"w": i32}), {"dtype": "bfloat16"}),
        cache.key("head", "config A", (f32, {"w": jax.ShapeDtypeStruct((2, 5), jnp.float32)}), {"dtype": "bfloat16"}),
        cache.key("head", "config A", (f32, {"v": f32}), {"dtype": "bfloat16"}),
        cache.key("head", "config A", (f32, (f32,)), {"dtype": "bfloat16"}),
        cache.key("head", "config A", (f32, {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32, sharding=device)}),
                  {"dtype": "bfloat16"}),
        cache.key("head", "config A", (f32, {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32, weak_type=True)}),
                  {"dtype": "bfloat16"}),
    ]
    assert base == cache.key("head", "config A", (f32, {"w": f32}), {"dtype": "bfloat16"})
    assert len({base, *changed}) == len(changed) + 1


def test_the_environment_key_follows_the_sources_jax_and_xla_flags(monkeypatch):
    from pdserve.server.prefill import executables

    key = executables.environment_key()
    assert executables.environment_key() == key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert executables.environment_key() != key
    monkeypatch.delenv("XLA_FLAGS")
    sources = executables._sources()
    assert any(p.name == "model.py" and p.parent.name == "prefill" for p in sources)
    assert any(p.parent.name == "kvcache" for p in sources)
    monkeypatch.setattr(executables, "_sources", lambda: sources[1:])  # a source changed (here: gone)
    assert executables.environment_key() != key
    monkeypatch.setattr(executables, "_sources", lambda: sources)
    monkeypatch.setattr(jax, "__version__", "0.0.0")
    assert executables.environment_key() != key


def test_a_program_without_a_cache_is_jax_jit_and_a_switch_turns_the_cache_off(monkeypatch, tmp_path):
    program = Program("double", jax.jit(lambda x: x * 2))
    assert program.compile(jax.ShapeDtypeStruct((3,), jnp.float32)) is not None
    np.testing.assert_array_equal(program(np.ones(3, np.float32)), [2, 2, 2])
    config = PrefillConfig(model_dir=tmp_path, compilation_cache=tmp_path / "jax")
    assert main.executable_cache(config).directory == tmp_path / "jax" / "pdserve-executables"
    assert main.executable_cache(PrefillConfig(model_dir=tmp_path, compilation_cache="none")) is None
    assert main.executable_cache(PrefillConfig(model_dir=tmp_path, executable_cache=False)) is None
    monkeypatch.setenv("PDSERVE_EXECUTABLE_CACHE", "0")
    assert main.executable_cache(config) is None
