"""Which matmul path the prefill computes with on the CPU backend, chosen by measurement (`--prefill-matmul`).

1. `runnable`: the paths that can serve these weights here. An fp32 checkpoint (or --weight-dtype float32)
   computes in fp32: `xla-fp32` only, so its greedy tokens stay transformers' own. A bf16 checkpoint may
   take `xla-fp32` (upcast at load, exact), `xla-bf16`, and `onednn-bf16` where torch's oneDNN runs a
   bf16 linear (`hardware.torch_probe`: none under PDSERVE_CPU_ISA=avx2) on one device. Quantized
   weights and the TPU/GPU backends keep XLA in their compute dtype: no choice is made.
2. `measure`: each path times one layer's dense matmuls of the model's own shapes (q, k, v, o, gate, up,
   down) at `PROBE_TOKENS` tokens, in a `lax.scan` over a small layer stack as the model runs them (XLA
   slicing each layer's weights out of the stack costs it more than a lone dot shows), through the same
   `Matmul` the model calls (the oneDNN path with its host callback), the paths interleaved and the fastest of `reps` kept; each result is checked against
   fp64 (an fp32 path to 1e-4, a bf16 one to 2e-2 of the largest output: bf16 operands, fp32
   accumulation), and a path that fails the check is not chosen.
3. `choose`: the fastest exact-enough path, cached per machine and model shape in
   `<cache dir>/prefill-matmul.json` (key: the CPU's model, features and cap, XLA_FLAGS and oneDNN's cap,
   jax/jaxlib/torch versions, the cores, the shapes), so a restart skips the timing. A forced path
   (`--prefill-matmul xla-bf16`) is taken as given, or refused at start when it cannot run here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pdserve.server.cache_dir import cache_dir
from pdserve.server.choices import PREFILL_MATMULS
from pdserve.server.model.config import ModelConfig

log = logging.getLogger("pdserve.prefill")

PATH_DTYPES = {"xla-fp32": "float32", "xla-bf16": "bfloat16", "onednn-bf16": "bfloat16"}
"""The weights' (and activations') dtype of each path."""
PROBE_TOKENS = 512
LAYERS = 2
"""The probe's layer stack: the weights are scanned over, as the model's are (XLA slices each layer's out)."""
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
"""Largest |error| / max |fp64 result| a path's dtype may show on the probe (exact enough)."""


@dataclass(frozen=True)
class MatmulChoice:
    path: str
    why: str
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of one layer's matmuls at the probe's tokens, per path measured (empty: nothing measured)."""

    @property
    def dtype(self) -> str:
        return PATH_DTYPES[self.path]

    def describe(self) -> str:
        """The start-up line's words, e.g. 'onednn-bf16 (fastest measured: ...)'."""
        return f"{self.path} ({self.why})"


def runnable(weight_dtype: str, checkpoint_dtype: str, onednn_bf16: bool, devices: int) -> list[str]:
    """The paths for these weights on the CPU backend (weight_dtype: --weight-dtype, auto or unquantized)."""
    if weight_dtype == "float32" or (weight_dtype == "auto" and checkpoint_dtype != "bfloat16"):
        return ["xla-fp32"]
    paths = (["xla-fp32"] if weight_dtype == "auto" else []) + ["xla-bf16"]
    return paths + (["onednn-bf16"] if onednn_bf16 and devices == 1 else [])


def layer_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(einsum spec, one layer's weight shape) of each dense matmul, as model.py calls them."""
    h, d, hq, hkv, i = config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads, \
        config.intermediate_size
    return [("bsh,hnd->bsnd", (h, hq, d)), ("bsh,hnd->bsnd", (h, hkv, d)), ("bsh,hnd->bsnd", (h, hkv, d)),
            ("bsnd,ndh->bsh", (hq, d, h)), ("bsh,hi->bsi", (h, i)), ("bsh,hi->bsi", (h, i)), ("bsi,ih->bsh", (i, h))]


def measure(paths: list[str], shapes: list[tuple[str, tuple[int, ...]]], tokens: int = PROBE_TOKENS,
            reps: int = 5) -> dict[str, tuple[float, float]]:
    """path -> (seconds of the layer's matmuls, relative error against fp64), measured here."""
    import jax
    import jax.numpy as jnp

    from pdserve.server.prefill.matmul import OnednnWeights, Resident, xla_matmul

    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((LAYERS, *shape), np.float32) / np.sqrt(np.prod(shape[: _k(spec)]))
               for spec, shape in shapes]  # [LAYERS, K..., N...] each
    inputs = [rng.standard_normal((1, tokens, *shape[: _k(spec)]), np.float32) for spec, shape in shapes]
    programs = {}
    for path in paths:
        dtype = jnp.dtype(PATH_DTYPES[path])
        matmul, ws = xla_matmul, [jnp.asarray(w, dtype) for w in weights]
        if path == "onednn-bf16":
            bank = OnednnWeights()
            matmul, ws = bank.matmul, [bank.hold(w, _k(spec)) for (spec, _), w in zip(shapes, weights)]

        def layers(xs, ws, matmul=matmul):  # a scan over the layer stack, as model.layer_group runs
            step = lambda carry, w: (carry, [matmul(spec, x, wi) for (spec, _), x, wi in zip(shapes, xs, w)])  # noqa: E731
            return jax.lax.scan(step, 0, ws)[1]

        programs[path] = jax.jit(layers), ([jnp.asarray(x, dtype) for x in inputs], ws)
    errors = {}
    for path, (fn, args) in programs.items():
        got = jax.block_until_ready(fn(*args))  # compiles, and is checked
        errors[path] = max(_relative_error(np.asarray(g[i], np.float64), spec, x, w[i])
                           for g, (spec, _), x, w in zip(got, shapes, inputs, weights) for i in range(LAYERS))
    best = {path: float("inf") for path in programs}
    for _ in range(reps):  # interleaved: a noisy neighbour slows every path alike
        for path, (fn, args) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[path] = min(best[path], time.perf_counter() - t0)
    return {path: (best[path] / LAYERS, errors[path]) for path in programs}


def _k(spec: str) -> int:
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    return sum(c in ws and c not in out for c in xs)


def _relative_error(got: np.ndarray, spec: str, x: np.ndarray, w: np.ndarray) -> float:
    want = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def cache_key(shapes: list, paths: list[str], tokens: int, threads: int) -> str:
    """What the timings depend on: the machine as the kernels see it, the software, the shapes."""
    import jax
    import jaxlib

    from pdserve.server import hardware

    cpu = hardware.cpu()
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    parts = {"cpu": cpu.model, "features": sorted(cpu.features), "cap": cpu.cap, "xla_flags": os.environ.get(
        "XLA_FLAGS", ""), "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""), "jax": jax.__version__,
        "jaxlib": jaxlib.__version__, "torch": torch_version, "threads": threads, "tokens": tokens,
        "shapes": shapes, "paths": paths}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cache_file() -> Path:
    return cache_dir() / "prefill-matmul.json"


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        log.warning("prefill matmul cache %s unreadable (%s): measuring again", path, e)
        return {}


def _write_cache(path: Path, key: str, choice: MatmulChoice) -> None:
    entries = _read_cache(path)
    entries[key] = asdict(choice)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        log.warning("prefill matmul choice not cached in %s (%s): the next start measures again", path, e)


def choose(requested: str, weight_dtype: str, config: ModelConfig, onednn_bf16: bool, devices: int,
           threads: int, cache: Path | None = None,
           timer: Callable[[list[str], list], dict[str, tuple[float, float]]] = measure) -> MatmulChoice:
    """The path for a CPU prefill worker; ValueError naming the flags for a forced path that cannot run here.
    `timer(paths, shapes)` -> path -> (seconds, relative error), `measure` unless a test fakes it."""
    if requested not in PREFILL_MATMULS:
        raise ValueError(f"--prefill-matmul must be one of {', '.join(PREFILL_MATMULS)}, not {requested!r}")
    paths = runnable(weight_dtype, config.dtype, onednn_bf16, devices)
    if requested != "auto":
        if requested == "onednn-bf16" and not (onednn_bf16 and devices == 1):
            why = "oneDNN runs no bf16 linear here (torch_probe: no AVX-512 bf16/AMX, or PDSERVE_CPU_ISA caps it)" \
                if not onednn_bf16 else f"it runs on one device, and this worker shards over {devices}"
            raise ValueError(f"--prefill-matmul onednn-bf16 cannot run: {why}; pass --prefill-matmul auto, xla-bf16 "
                             f"or xla-fp32")
        if weight_dtype not in ("auto", PATH_DTYPES[requested]):
            raise ValueError(f"--prefill-matmul {requested} computes in {PATH_DTYPES[requested]}, --weight-dtype "
                             f"{weight_dtype} asks for {weight_dtype}: pass one of them (or --prefill-matmul auto)")
        return MatmulChoice(requested, "forced by --prefill-matmul")
    if len(paths) == 1:
        return MatmulChoice(paths[0], f"the only exact path for {config.dtype} weights"
                            if weight_dtype == "auto" else f"--weight-dtype {weight_dtype}")
    shapes = layer_shapes(config)
    path = cache or cache_file()
    key = cache_key(shapes, paths, PROBE_TOKENS, threads)
    if (hit := _read_cache(path).get(key)) is not None and hit.get("path") in paths:
        return MatmulChoice(hit["path"], f"{hit['why']}; cached in {path}", hit.get("timings", {}))
    results = timer(paths, shapes)
    exact = {p: t for p, (t, err) in results.items() if err <= TOLERANCE[PATH_DTYPES[p]]}
    if not exact:
        raise RuntimeError(f"no prefill matmul path computed exactly enough here ({_shown(results)}); pass "
                           f"--prefill-matmul xla-fp32 and report this machine")
    best = min(exact, key=exact.__getitem__)
    refused = [p for p in results if p not in exact]
    why = f"fastest measured: {_shown(results)} for one layer's matmuls at {PROBE_TOKENS} tokens" + \
        (f"; not exact enough: {', '.join(refused)}" if refused else "")
    choice = MatmulChoice(best, why, {p: t for p, (t, _) in results.items()})
    _write_cache(path, key, choice)
    return choice


def _shown(results: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{p} {t * 1e3:.1f} ms (error {err:.1e})" for p, (t, err) in results.items())
