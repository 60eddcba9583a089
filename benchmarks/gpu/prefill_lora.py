"""The prefill tier's LoRA programs (`server/prefill/lora_rows.py`) for `benchmarks/gpu.py` (inside its `prefill`
stage), correctness before speed:

1. check (group "prefill-lora"): one packed step of the served PrefillEngine (--enable-lora, bf16 on a GPU, fp32 on
   a CPU) mixing a base prompt and two adapters of different ranks and targets (rank 8 on q/k/v/o_proj, rank 16 on
   gate/up/down_proj) against references computed without the slot machinery: for each prompt, an engine without
   --enable-lora over fp32 weights merged with its adapter (W + scaling * B @ A per layer and projection). Every
   layer's KV and every prompt position's logprob must agree (tolerances for bf16), and each adapter must move its
   prompt's KV well beyond the tolerance (else the check could not fail). A Llama-3-8B-shape model of 2 layers on
   the GPU, the tiny Llama in a dry run; random weights and adapters made in memory.
2. timing: a packed step of 8 prompts x 512 tokens on a Llama-3-8B-shape model of 8 layers (bf16), every token the
   base model, against the same step with the prompts naming 4 adapters (ranks 8/16/8/16 on attention, MLP, all
   seven and q/v projections: benchmarks/engine/lora_prefill.py's mix), on one --enable-lora engine (the base step
   skips the deltas there, as it runs on a --enable-lora worker), and the base step on an engine without
   --enable-lora over the same weight arrays: each timed from enqueue to the last prompt's first token, in turn, the
   median of the repetitions after an untimed first that compiles. The row with a target is the base step's time /
   the mixed step's time, target >= 1 / 1.3 (issue 41: a step mixing 4 adapters takes at most 1.3x the base step's
   time); beside it, what --enable-lora costs a base step (each projection's delta sits behind a `lax.cond` on
   whether any token has an adapter).
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import time
from pathlib import Path

import numpy as np

CHECK_LAYERS = 2
TIMED_LAYERS = 8
CHECK_ADAPTERS = {"attn-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
                  "mlp-r16": (16, ("gate_proj", "up_proj", "down_proj"))}
TIMED_ADAPTERS = {"attn-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
                  "mlp-r16": (16, ("gate_proj", "up_proj", "down_proj")),
                  "all-r8": (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
                  "qv-r16": (16, ("q_proj", "v_proj"))}
MAX_RANK = 16
PARAM = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate", "up_proj": "w_up",
         "down_proj": "w_down"}
"""Each projection's weight in load_params' layout ([L, in..., out...]: `x @ W` reshaped)."""


def random_lora(name: str, rank: int, targets: tuple[str, ...], config, seed: int):
    """A LoraCheckpoint (as load_lora returns) of random A [r, in] and B [out, r] for every layer, scaling 2 (alpha =
    2r): each delta (x @ A) @ B of about 0.6 in each output (a Llama-3-8B projection's base output: about 1.3),
    far above bf16's rounding."""
    from pdserve.server.model.lora import LoraCheckpoint, projection_shapes

    rng, shapes, weights = np.random.default_rng(seed), projection_shapes(config), {}
    for layer in range(config.num_layers):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            a = rng.standard_normal((rank, fan_in)) / fan_in**0.5
            b = 0.3 * rng.standard_normal((fan_out, rank)) / rank**0.5
            weights[(layer, proj)] = (a.astype(np.float32), b.astype(np.float32))
    return LoraCheckpoint(name, f"memory:{name}", rank, 2.0, weights)


def merged_params(params: dict, ckpt) -> dict:
    """fp32 params with the adapter merged into each weight it targets: W + scaling * (B @ A).T, per layer."""
    import jax
    import jax.numpy as jnp

    out = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    layers = dict(out["layers"])
    for (layer, proj), (a, b) in (ckpt.weights.items() if ckpt is not None else ()):
        w = layers[PARAM[proj]]
        delta = (np.float32(ckpt.scaling) * (b @ a).T).reshape(w.shape[1:])  # [in, out] -> the weight's layout
        layers[PARAM[proj]] = w.at[layer].add(jnp.asarray(delta))
    out["layers"] = layers
    return out


def _engine(config, params, where, tokens: int, prompts: int, lora: bool):
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.engine import PrefillEngine

    flags = dict(enable_lora=True, max_loras=4, max_cpu_loras=4, max_lora_rank=MAX_RANK) if lora else {}
    return PrefillEngine(config, params, PrefillConfig(model_dir=Path(where), max_batch_size=prompts,
                                                       max_model_len=tokens, max_batch_tokens=prompts * tokens,
                                                       prefix_cache_bytes=0, kv_layer_groups=1, **flags))


def _pack(engine, ckpt, key_id: int):
    from pdserve.kvcache.adapter_key import AdapterKey
    from pdserve.server.prefill.lora import PrefillAdapter

    lora = engine.lora
    return PrefillAdapter.pack(AdapterKey(key_id, ckpt.name, ckpt.path), ckpt, engine.model_config, lora.max_rank,
                               lora.dtype)


def _recording(engine) -> list[int]:
    """The number of segments of each step the engine runs (one packed step: [3])."""
    steps, next_step = [], engine.scheduler.next_step

    def recording():
        step = next_step()
        if step:
            steps.append(len(step))
        return step

    engine.scheduler.next_step = recording
    return steps


def _logprobs(result) -> np.ndarray:
    return np.array([lp.logprob for lp in result.prompt_logprobs], np.float64)


def _config(dry_run: bool, layers: int, where):
    from pdserve.benchmarks.gpu.prefill import LLAMA3_8B, TINY
    from pdserve.server.model.config import parse_config

    return parse_config(dict(TINY if dry_run else LLAMA3_8B, num_hidden_layers=layers), Path(where))


def _jax(dry_run: bool):
    """jax, its compute dtype and KV dtype here: bf16 on an accelerator, fp32 on a CPU (as the CPU backend serves)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    cuda = jax.default_backend() != "cpu"
    return jax, cuda, *((jnp.bfloat16, "bfloat16") if cuda else (jnp.float32, "float32"))


def lora_check(where, dry_run: bool, check_type) -> list:
    """Group "prefill-lora": a step mixing the base and 2 adapters against merged-weight references (see above)."""
    jax, cuda, dtype, kv_dtype = _jax(dry_run)
    import jax.numpy as jnp

    from pdserve.benchmarks.gpu.prefill import random_params
    from pdserve.v1 import generation_pb2 as gen_pb

    kv_tol, lp_tol = (3e-2, 0.1) if cuda else (1e-4, 1e-3)
    config = _config(dry_run, CHECK_LAYERS, where)
    params = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.bfloat16 else a, random_params(config, seed=3))
    ckpts = {n: random_lora(n, r, t, config, seed=i) for i, (n, (r, t)) in enumerate(CHECK_ADAPTERS.items())}
    rng = np.random.default_rng(7)
    names = ["base", *ckpts]
    prompts = {n: rng.integers(3, config.vocab_size, length).tolist() for n, length in zip(names, (24, 40, 33))}
    sampling = gen_pb.SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=0)
    name = (f"prefill LoRA step (base + ranks 8 and 16, {str(np.dtype(dtype))}) vs merged-weight fp32 references, "
            f"{config.num_layers} layers, hidden {config.hidden_size}")
    try:
        async def mixed() -> tuple[list, list[int]]:
            engine = _engine(config, params, where, 64, len(names), lora=True)
            steps = _recording(engine)
            packed = {n: _pack(engine, c, i + 1) for i, (n, c) in enumerate(ckpts.items())}
            results = await asyncio.gather(*(engine.submit(prompts[n], sampling, 0, kv_dtype, adapter=packed.get(n))
                                             for n in names))
            engine.close()
            return results, steps

        async def reference(ckpt) -> list:
            engine = _engine(config, merged_params(params, ckpt), where, 64, len(names), lora=False)
            results = await asyncio.gather(*(engine.submit(prompts[n], sampling, 0, "float32") for n in names))
            engine.close()
            return results

        got, steps = asyncio.run(mixed())
        refs = {"base": asyncio.run(reference(None))}
        gc.collect()
        for n, ckpt in ckpts.items():
            refs[n] = asyncio.run(reference(ckpt))
            gc.collect()
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        return [check_type(name, False, f"raised {e!r}", group="prefill-lora")]
    kv_err, lp_err, moved = 0.0, 0.0, {}
    for i, n in enumerate(names):
        want = refs[n][i]
        scale = max(float(np.abs(want.k).max()), float(np.abs(want.v).max()))
        for ours, theirs in ((got[i].k, want.k), (got[i].v, want.v)):
            kv_err = max(kv_err, float(np.abs(ours.astype(np.float32) - theirs).max()) / scale)
        lp_err = max(lp_err, float(np.abs(_logprobs(got[i]) - _logprobs(want)).max()))
        if n != "base":  # how far the adapter moves its prompt from the base model's KV
            plain = refs["base"][i]
            moved[n] = max(float(np.abs(plain.k - want.k).max()), float(np.abs(plain.v - want.v).max())) / scale
    one_step = steps == [len(names)]
    passed = one_step and kv_err < kv_tol and lp_err < lp_tol and all(m > 3 * kv_tol for m in moved.values())
    detail = (f"KV max error {kv_err:.2e} of the largest value (tolerance {kv_tol:g}), prompt logprobs max error "
              f"{lp_err:.2e} (tolerance {lp_tol:g}); the adapters move their KV by "
              + ", ".join(f"{n} {m:.2f}" for n, m in moved.items())
              + f" (must exceed {3 * kv_tol:g}); steps run {steps} (one packed step of {len(names)} wanted)")
    return [check_type(name, passed, detail, kv_err, "prefill-lora")]


def lora_rows(where, dry_run: bool, out, row_type, log) -> None:
    """Base step vs the step mixing 4 adapters on one --enable-lora engine (see above): rows "prefill lora"."""
    jax, _, dtype, kv_dtype = _jax(dry_run)
    import jax.numpy as jnp

    from pdserve.benchmarks.gpu.prefill import random_params
    from pdserve.v1 import generation_pb2 as gen_pb

    prompts, tokens, reps = (4, 16, 1) if dry_run else (8, 512, 5)
    config = _config(dry_run, 2 if dry_run else TIMED_LAYERS, where)
    params = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.bfloat16 else a, random_params(config, seed=5))
    ckpts = [random_lora(n, r, t, config, seed=10 + i) for i, (n, (r, t)) in enumerate(TIMED_ADAPTERS.items())]
    rng = np.random.default_rng(0)
    batch = [rng.integers(3, config.vocab_size, tokens).tolist() for _ in range(prompts)]
    greedy = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)

    async def measure() -> dict[str, list[float]]:
        engines = {"off": _engine(config, params, where, tokens, prompts, lora=False),
                   "on": _engine(config, params, where, tokens, prompts, lora=True)}
        packed = [_pack(engines["on"], c, i + 1) for i, c in enumerate(ckpts)]
        cases = {"base (off)": ("off", [None] * prompts), "base": ("on", [None] * prompts),
                 "mixed": ("on", [packed[i % len(packed)] for i in range(prompts)])}
        times: dict[str, list[float]] = {c: [] for c in cases}
        for rep in range(reps + 1):  # the first untimed: it compiles each engine's step program
            for case, (engine, adapters) in cases.items():
                t = time.perf_counter()
                jobs = [engines[engine].enqueue(p, greedy, 0, kv_dtype, adapter=a) for p, a in zip(batch, adapters)]
                for job in jobs:  # enqueued together: one packed step
                    await job.first_token
                elapsed = time.perf_counter() - t
                for job in jobs:  # the KV reaches the host too, untimed
                    while await job.kv.get() is not None:
                        pass
                if rep:
                    times[case].append(elapsed)
            log(f"prefill lora: rep {rep}: compiled" if not rep else f"prefill lora: rep {rep}: " +
                ", ".join(f"{c} {t[-1] * 1e3:.1f} ms" for c, t in times.items()))
        for engine in engines.values():
            engine.close()
        return times

    times = asyncio.run(measure())
    off, base, mixed = (statistics.median(times[c]) for c in ("base (off)", "base", "mixed"))
    what = (f"{prompts} prompts x {tokens} tokens, one step, {len(ckpts)} adapters of ranks 8/16 "
            f"({config.num_layers}-layer {'Llama-3-8B shape' if not dry_run else 'tiny llama'})")
    out.row(row_type("prefill lora", f"{what}: ms, mixed vs base only", mixed * 1e3, base * 1e3, "ms"),
            row_type("prefill lora", f"{what}: base time / mixed time (target: mixed <= 1.3x)", base / mixed, 1.0,
                     "x", target=1 / 1.3, needs=("prefill-lora",)),
            row_type("prefill lora", f"{what}: base step's time without --enable-lora / with it", off / base, 1.0,
                     "x"))
