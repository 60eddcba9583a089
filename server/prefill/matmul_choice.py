"""Which matmul path the prefill computes with on the CPU backend, chosen by measurement (`--prefill-matmul`).

1. `runnable`: the paths that can serve these weights here. An fp32 checkpoint (or --weight-dtype float32)
   computes in fp32: `xla-fp32` only, so its greedy tokens stay transformers' own. A bf16 checkpoint may
   take `xla-fp32` (upcast at load, exact), `xla-bf16`, and `onednn-bf16` where torch's oneDNN runs a
   bf16 linear (`hardware.torch_probe`: none under PDSERVE_CPU_ISA=avx2) on one device. Quantized
   weights and the TPU/GPU backends keep XLA in their compute dtype: no choice is made.
2. `measure`: each path times one layer's dense work of the model's own shapes at `PROBE_TOKENS` tokens as the
   model runs it (XLA: q, k, v, o, gate, up, down, the activation between; onednn-bf16: q/k/v as one packed
   linear, o, and the fused MLP in one host call), in a `lax.scan` over a small layer stack (XLA slicing each
   layer's weights out of the stack costs it more than a lone dot shows), the paths interleaved and the fastest
   of `reps` kept; each result is checked against fp64 (an fp32 path to 1e-4, a bf16 one to 2e-2 of the largest
   output: bf16 operands, fp32 accumulation), and a path that fails the check is not chosen.
3. `choose`: the fastest exact-enough path, cached per machine and model shape in
   `<cache dir>/prefill-matmul.json` (key: the CPU's model, features and cap, XLA_FLAGS and oneDNN's cap,
   jax/jaxlib/torch versions, the cores, the shapes), so a restart skips the timing. A forced path
   (`--prefill-matmul xla-bf16`) is taken as given, or refused at start when it cannot run here.
4. `choose_attention`: beside onednn-bf16, where attention runs (`--prefill-attention`): XLA's blockwise kernel or
   torch's flash attention on the host (host_attention.py), timed the same way on one causal prompt of
   `PROBE_TOKENS` tokens with the model's heads, checked against fp64, cached in the same file.
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
from pdserve.server.choices import PREFILL_ATTENTIONS, PREFILL_MATMULS
from pdserve.server.model.config import ModelConfig

log = logging.getLogger("pdserve.prefill")

PATH_DTYPES = {"xla-fp32": "float32", "xla-bf16": "bfloat16", "onednn-bf16": "bfloat16"}
"""The weights' (and activations') dtype of each path."""
PROBE_TOKENS = 512
LAYERS = 2
"""The probe's layer stack: the weights are scanned over, as the model's are (XLA slices each layer's out)."""
PROBE = 2
"""The probe's version, in the cache key: a new one measures again (2: packed q/k/v and the fused MLP)."""
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


@dataclass(frozen=True)
class AttentionChoice:
    where: str
    """"host" (host_attention.py) or "xla" (attention.py)."""
    why: str
    timings: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.where} ({self.why})"


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
    """path -> (seconds of one layer's dense work, relative error against fp64), measured here. `shapes`:
    `layer_shapes` (q, k, v, o, gate, up, down)."""
    import jax
    import jax.numpy as jnp

    from pdserve.server.prefill.matmul import OnednnWeights, xla_matmul

    (qs, wq), (_, wk), (_, wv), (os_, wo), (gs, wg), (_, wu), (ds, wd) = shapes
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((LAYERS, *shape), np.float32) / np.sqrt(np.prod(shape[: _k(spec)]))
               for spec, shape in shapes]  # [LAYERS, K..., N...] each
    h = rng.standard_normal((1, tokens, wq[0]), np.float32)  # [1, T, H]: q, k, v, gate and up read it
    attn = rng.standard_normal((1, tokens, *wo[:2]), np.float32)  # [1, T, Hq, D]: o reads it
    programs = {}
    for path in paths:
        dtype = jnp.dtype(PATH_DTYPES[path])
        if path == "onednn-bf16":
            bank = OnednnWeights()
            qkv = bank.hold(np.concatenate(weights[:3], axis=2), 1)
            ws = [qkv, bank.hold(weights[3], 2), *(bank.hold(w, 1) for w in weights[4:])]
            n = (wq[1], wk[1])

            def one(x, a, w, bank=bank, n=n):  # as model._layer runs it: packed q/k/v, o, the fused MLP
                y = bank.matmul(qs, x, w[0])
                return [y[:, :, : n[0]], y[:, :, n[0] : n[0] + n[1]], y[:, :, n[0] + n[1] :],
                        bank.matmul(os_, a, w[1]), bank.mlp(x, w[2], w[3], w[4], "silu")]
        else:
            ws = [jnp.asarray(w, dtype) for w in weights]

            def one(x, a, w):  # as model._layer runs it with XLA's matmuls
                gate, up = xla_matmul(gs, x, w[4]), xla_matmul(gs, x, w[5])
                return [xla_matmul(qs, x, w[0]), xla_matmul(qs, x, w[1]), xla_matmul(qs, x, w[2]),
                        xla_matmul(os_, a, w[3]), xla_matmul(ds, jax.nn.silu(gate) * up, w[6])]

        def layers(x, a, ws, one=one):  # a scan over the layer stack, as model.layer_group runs
            return jax.lax.scan(lambda carry, w: (carry, one(x, a, w)), 0, ws)[1]

        programs[path] = jax.jit(layers), (jnp.asarray(h, dtype), jnp.asarray(attn, dtype), ws)
    errors = {}
    for path, (fn, args) in programs.items():
        got = jax.block_until_ready(fn(*args))  # compiles, and is checked
        errors[path] = max(_relative_error(np.asarray(g[i], np.float64), want)
                           for i in range(LAYERS) for g, want in zip(got, _layer_want(shapes, h, attn, weights, i)))
    best = {path: float("inf") for path in programs}
    for _ in range(reps):  # interleaved: a noisy neighbour slows every path alike
        for path, (fn, args) in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[path] = min(best[path], time.perf_counter() - t0)
    return {path: (best[path] / LAYERS, errors[path]) for path in programs}


def _layer_want(shapes: list, h: np.ndarray, attn: np.ndarray, weights: list[np.ndarray], i: int) -> list[np.ndarray]:
    """Layer i's q, k, v, o and MLP outputs in fp64."""
    h64, a64 = h.astype(np.float64), attn.astype(np.float64)
    w = [x[i].astype(np.float64) for x in weights]
    spec = [s for s, _ in shapes]
    gate, up = np.einsum(spec[4], h64, w[4]), np.einsum(spec[5], h64, w[5])
    hidden = gate / (1 + np.exp(-gate)) * up
    return [np.einsum(spec[0], h64, w[0]), np.einsum(spec[1], h64, w[1]), np.einsum(spec[2], h64, w[2]),
            np.einsum(spec[3], a64, w[3]), np.einsum(spec[6], hidden, w[6])]


def measure_attention(config: ModelConfig, tokens: int = PROBE_TOKENS, reps: int = 3) -> dict[str, tuple[float, float]]:
    """"xla" / "host" -> (seconds of one layer's attention over one causal prompt of `tokens` tokens, bf16, the
    model's heads; relative error against fp64)."""
    import jax
    import jax.numpy as jnp

    from pdserve.server.prefill.attention import attention
    from pdserve.server.prefill.host_attention import host_attention

    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, tokens, n, d), np.float32) for n in (hq, hkv, hkv))
    pos = jnp.arange(tokens, dtype=jnp.int32)[None]
    seg = jnp.zeros((1, tokens), jnp.int32)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    programs = {name: jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, pos, seg, pos, seg, own_keys_from=0,
                                                        scale=config.scale))
                for name, fn in (("xla", attention), ("host", host_attention))}
    want = _attention_want(*(np.asarray(a, np.float64) for a in args), config.scale)
    errors = {name: _relative_error(np.asarray(jax.block_until_ready(fn(*args)), np.float64), want)
              for name, fn in programs.items()}
    best = {name: float("inf") for name in programs}
    for _ in range(reps):
        for name, fn in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], time.perf_counter() - t0)
    return {name: (best[name], errors[name]) for name in programs}


def _attention_want(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float | None) -> np.ndarray:
    """Causal attention of one prompt in fp64: q [1, T, Hq, D], k, v [1, T, Hkv, D] -> [1, T, Hq, D]."""
    t, hq, d = q.shape[1:]
    g = hq // k.shape[2]
    kk, vv = np.repeat(k[0], g, axis=1), np.repeat(v[0], g, axis=1)  # [T, Hq, D]
    scores = np.einsum("qhd,khd->hqk", q[0], kk) * (d**-0.5 if scale is None else scale)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, vv)[None]


def _k(spec: str) -> int:
    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    return sum(c in ws and c not in out for c in xs)


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
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
        "shapes": shapes, "paths": paths, "probe": PROBE}
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


def _write_cache(path: Path, key: str, choice: MatmulChoice | AttentionChoice) -> None:
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
    best, why = _fastest_exact(results, {p: TOLERANCE[PATH_DTYPES[p]] for p in results}, "one layer's matmuls",
                               "matmul path", "--prefill-matmul xla-fp32")
    choice = MatmulChoice(best, why, {p: t for p, (t, _) in results.items()})
    _write_cache(path, key, choice)
    return choice


def choose_attention(requested: str, matmul_path: str, config: ModelConfig, threads: int, cache: Path | None = None,
                     timer: Callable[[ModelConfig], dict[str, tuple[float, float]]] = measure_attention
                     ) -> AttentionChoice:
    """Where attention runs beside `matmul_path` (--prefill-attention); ValueError naming the flags for a forced
    host attention that cannot run. `timer(config)` -> "xla"/"host" -> (seconds, relative error), measured
    unless a test fakes it."""
    if requested not in PREFILL_ATTENTIONS:
        raise ValueError(f"--prefill-attention must be one of {', '.join(PREFILL_ATTENTIONS)}, not {requested!r}")
    if matmul_path != "onednn-bf16":
        if requested == "host":
            raise ValueError(f"--prefill-attention host runs beside --prefill-matmul onednn-bf16, and this worker's "
                             f"matmuls are {matmul_path}: pass --prefill-attention auto or xla")
        return AttentionChoice("xla", f"beside {matmul_path}")
    if config.attn_softcap is not None:  # host_attention.py keeps XLA's for soft-capped scores
        return AttentionChoice("xla", "the model soft-caps its scores, which the host kernel does not")
    if requested != "auto":
        return AttentionChoice(requested, "forced by --prefill-attention")
    path = cache or cache_file()
    key = cache_key([("attention", config.num_heads, config.num_kv_heads, config.head_dim, config.scale)],
                    ["xla", "host"], PROBE_TOKENS, threads)
    if (hit := _read_cache(path).get(key)) is not None and hit.get("where") in ("xla", "host"):
        return AttentionChoice(hit["where"], f"{hit['why']}; cached in {path}", hit.get("timings", {}))
    results = timer(config)
    best, why = _fastest_exact(results, dict.fromkeys(results, TOLERANCE["bfloat16"]), "one layer",
                               "attention", "--prefill-attention xla")
    choice = AttentionChoice(best, why, {p: t for p, (t, _) in results.items()})
    _write_cache(path, key, choice)
    return choice


def _fastest_exact(results: dict[str, tuple[float, float]], tolerance: dict[str, float], what: str, kind: str,
                   fallback: str) -> tuple[str, str]:
    """The fastest of the measured paths whose error is within its tolerance, and the start-up line's why;
    RuntimeError naming `fallback` (the flag to pass) when none is."""
    exact = {p: t for p, (t, err) in results.items() if err <= tolerance[p]}
    if not exact:
        raise RuntimeError(f"no prefill {kind} computed exactly enough here ({_shown(results)}); pass {fallback} "
                           f"and report this machine")
    refused = [p for p in results if p not in exact]
    why = f"fastest measured: {_shown(results)} for {what} at {PROBE_TOKENS} tokens" + \
        (f"; not exact enough: {', '.join(refused)}" if refused else "")
    return min(exact, key=exact.__getitem__), why


def _shown(results: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{p} {t * 1e3:.1f} ms (error {err:.1e})" for p, (t, err) in results.items())
