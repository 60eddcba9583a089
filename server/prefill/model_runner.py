"""The prefill's device programs: jitted once per engine, dispatched per step, compiled ahead of time.

`ModelRunner` owns what runs on the device (embed, each layer group, the head, penalties and sampling,
prompt logprobs, the KV's conversion to each wire format) and nothing of the queue: the engine
(engine.py) packs a step into `StepInputs` (step_packing.py) and hands it to `dispatch`, which every
process of a slice runs on the same inputs (replay.py). `compile_*` lower and compile the same
programs for a shape without running them (warmup.py decides which and when).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED
from pdserve.server import logprobs
from pdserve.server.model.config import ModelConfig
from pdserve.server.prefill.executables import ExecutableCache, Program
from pdserve.server.prefill.lora import PrefillLoras
from pdserve.server.prefill.lora_rows import LoraRows
from pdserve.server.prefill.kernels import Kernels
from pdserve.server.prefill.matmul import Matmul, xla_matmul
from pdserve.server.prefill.model import Packing, embed, head, layer_group, prompt_logprobs_head, split_layers
from pdserve.server.prefill.quant import quantize_kv_masked
from pdserve.server.prefill.sampler import penalize, sample
from pdserve.server.prefill.sharding import host_readable
from pdserve.server.prefill.step_inputs import StepInputs
from pdserve.server.prefill.shapes import pow2
from pdserve.server.prefill.step_packing import StepShape


@dataclass(frozen=True)
class StepOutputs:
    """What `ModelRunner.dispatch` returns, on the device (replicated over a mesh that spans processes)."""

    logits: jax.Array | None
    """f32 [R, V] at the finishing prompts' last tokens, before penalties (None: none finishes)."""
    first: jax.Array | None
    """int32 [R]: their sampled first tokens."""
    prompt_logprobs: tuple[jax.Array, jax.Array, jax.Array] | None
    """chosen [1, T], top ids and logprobs [1, T, top], when a prompt asks for them."""
    kv: list[tuple[int, dict[tuple[str, int], tuple], jax.Array, jax.Array]]
    """Each layer group's first layer, its KV in each wire format (k, v, k scales, v scales; scales None
    unquantized; v and its scales None for an MLA model's latent entries), and its k, v [l, 1, T, Hkv, D] in the
    compute dtype (an MLA model's v [l, 1, T, 1, 0])."""

    def wait(self) -> None:
        """Returns when every program of the step has run (what a slice's follower waits for)."""
        jax.block_until_ready([self.logits, self.first, self.prompt_logprobs,
                               [(k, v, *wire.values()) for _, wire, k, v in self.kv]])


class ModelRunner:
    def __init__(self, model_config: ModelConfig, params, groups: list[tuple[int, int]], max_batch_size: int,
                 matmul: Matmul | Kernels = xla_matmul, lora: PrefillLoras | None = None,
                 executables: ExecutableCache | None = None):
        """lora: the LoRA adapters' device slots (--enable-lora): every layer group's program then takes their
        stacks and each token's slot; None: the programs have no LoRA input at all. executables: where
        `compile_*` load the programs' executables from, and store them (executables.py); None, or a matmul
        path that calls host code: each compiles as JAX compiles it."""
        self.model_config = model_config
        self.lora = lora
        self.groups = groups
        """(first layer, layers) of each group the prefill runs and ships as one."""
        self.group_layers = split_layers(params["layers"], groups)
        """Each group's own weight stack; no stack of all layers is kept beside them."""
        self.params = {name: value for name, value in params.items() if name != "layers"}
        """embed, final_norm, [lm_head]."""
        self.max_batch_size = max_batch_size
        self.dtype = params["embed"].dtype
        self.vocab_size = self.params.get("lm_head", self.params["embed"]).shape[0]
        out = host_readable(params)  # on a mesh that spans processes: outputs replicated, for process 0 to read
        if matmul is not xla_matmul:  # the oneDNN path's programs call into the host's prepacked weights
            executables = None
        self.executables = executables

        def program(name: str, fn, bound: str = "", **jit) -> Program:
            return Program(name, jax.jit(fn, **jit, **out), f"{bound} {out}", executables)

        model = repr(model_config)
        top = min(logprobs.MAX_LOGPROBS, model_config.vocab_size)
        self._embed = program("embed", partial(embed, config=model_config), model)
        self._group = program("layer_group", partial(layer_group, config=model_config, matmul=matmul),
                              f"{model} {'xla_matmul' if matmul is xla_matmul else type(matmul).__name__}")
        self._head = program("head", partial(head, config=model_config), model)
        self._penalize = program("penalize", penalize)
        self._sample = program("sample", sample)
        self._prompt_logprobs = program("prompt_logprobs", partial(prompt_logprobs_head, config=model_config, top=top),
                                        f"{model} top {top}")
        self._quantize_kv = program("quantize_kv", quantize_kv_masked, static_argnames=("block_size", "fmt"))
        self._cast = program("cast", _cast, static_argnames=("dtype",))
        self._kv_avals: dict[tuple[int, int], jax.ShapeDtypeStruct] = {}
        """A layer group's k [l, 1, T, Hkv, D] as its program returns it, by (token slots, layers): what the
        wire formats' programs take (`compile_wire`)."""
        self._wire_compiled: set[tuple[int, str, int]] = set()
        """(token slots, dtype, block size) of the wire formats `compile_wire` compiled."""

    def dispatch(self, inputs: StepInputs, to_host: bool = True) -> StepOutputs:
        """Dispatches one step's programs, in this order (on every process of a slice): embed, each layer
        group, the head and sampling of the finishing prompts, their prompt logprobs, then each group's KV
        converted to each wire format (queued behind the sampling, so a first token never waits for KV)
        and, `to_host`, copying to the host as it is ready (a slice's other processes read nothing)."""
        packing = inputs.packing
        x, cos, sin = self._embed(self.params, inputs.tokens, packing.positions)  # [1, T, H], [1, T, D] x2
        kv = []  # (first layer, k, v [l, 1, T, Hkv, D]) of each group, on the device
        # The groups are dispatched back to back: XLA runs them while the host goes on.
        for g, ((start, size), layers) in enumerate(zip(self.groups, self.group_layers)):
            x, k, v = self._group(layers, x, cos, sin, packing, inputs.context[0, start : start + size],
                                  inputs.context[1, start : start + size], self._lora_rows(g, inputs.lora_slots))
            kv.append((start, k, v))
        logits = first = prompt_lp = None
        if inputs.head_rows is not None:
            logits = self._head(self.params, x, inputs.head_rows)  # [R, V]
            penalized = logits if inputs.penalties is None else self._penalize(logits, *inputs.penalties)
            first = self._sample(penalized, *inputs.sampling)  # [R]
        if inputs.next_tokens is not None:
            prompt_lp = self._prompt_logprobs(self.params, x, inputs.next_tokens)
        valid = packing.segments >= 0  # [1, T]
        wire = [(start, {f: self.to_wire(k, v, valid, *f, to_host=to_host) for f in inputs.formats}, k, v)
                for start, k, v in kv]
        return StepOutputs(logits, first, prompt_lp, wire)

    def _lora_rows(self, group: int, slots) -> LoraRows | None:
        """Layer group `group`'s LoRA input: its slot stacks and the tokens' slots [1, T] (None without LoRA)."""
        if self.lora is None:
            return None
        if slots is None:
            raise ValueError("a step without LoRA slots on a worker with --enable-lora (every step packs them)")
        return LoraRows(self.lora.stacks[group], slots)

    def to_wire(self, k: jax.Array, v: jax.Array, valid, dtype: str, block_size: int, to_host: bool = True):
        """(k, v, k_scales, v_scales) in the wire format, (`to_host`) already copying to the host; v and v_scales
        None for an MLA model's latent entries (v [.., 0])."""
        latent = v.shape[-1] == 0  # an MLA model's entries: no V (None here; the engine's pieces carry it empty)
        if dtype in QUANTIZED:  # on the device, over the real tokens' blocks
            qk, k_scales = self._quantize_kv(k, valid, block_size=block_size, fmt=dtype)
            qv, v_scales = (None, None) if latent else self._quantize_kv(v, valid, block_size=block_size, fmt=dtype)
            arrays = (qk, qv, k_scales, v_scales)
        else:
            same = k.dtype == NUMPY_DTYPES[dtype]
            cast = (lambda a: a) if same else partial(self._cast, dtype=dtype)  # noqa: E731
            arrays = (cast(k), None if latent else cast(v), None, None)
        for a in arrays if to_host else ():
            if a is not None:
                a.copy_to_host_async()
        return arrays

    def compile_step(self, shape: StepShape) -> list[jax.ShapeDtypeStruct]:
        """The programs of one step shape: embed, each layer group's size, the KV's cast to the
        unquantized wire dtypes, the head at every row count, and the prompt logprobs."""
        c, spec = self.model_config, jax.ShapeDtypeStruct
        ints = spec((1, shape.tokens), jnp.int32)
        ctx = spec((1, shape.context), jnp.int32)
        packing = Packing(ints, ints, ctx, ctx)
        x, cos, sin = _avals(self._embed.compile(self.params, ints, ints))
        casts = {d for d in ("float32", "bfloat16") if jnp.dtype(d) != x.dtype}
        done = set()  # (size, x's sharding): the groups' programs differ only in these
        slots = spec((1, shape.tokens), jnp.int32)
        for g, ((_, size), layers) in enumerate(zip(self.groups, self.group_layers)):  # x comes from the group before
            if (size, x.sharding) not in done:
                done.add((size, x.sharding))
                context = spec((size, 1, shape.context, c.num_kv_heads, c.head_dim), self.dtype)
                lora = self._lora_rows(g, slots)
                x, k, _ = _avals(self._group.compile(layers, x, cos, sin, packing, context, context, lora))
                self._kv_avals[shape.tokens, size] = k
                for dtype in casts:
                    self._cast.compile(k, dtype=dtype)
        logits = [_avals(self._head.compile(self.params, x, spec((r,), jnp.int32)))[0]
                  for r in (1 << i for i in range(pow2(self.max_batch_size).bit_length()))]
        self._prompt_logprobs.compile(self.params, x, ints)
        return logits  # [R, V] at each row count R

    def wire_compiled(self, tokens: int, fmt: tuple[str, int]) -> bool:
        """Whether a step of `tokens` slots (its shape compiled by `compile_step`) converts its KV to the wire
        format `fmt` (dtype, block size) with programs compiled: the compute dtype needs none, float32 and
        bfloat16 casts come with the step, the others once `compile_wire` compiled them."""
        dtype, block_size = fmt
        if dtype not in QUANTIZED and (jnp.dtype(dtype) == self.dtype or dtype in ("float32", "bfloat16")):
            return True
        return (tokens, dtype, block_size) in self._wire_compiled

    def compile_wire(self, tokens: int, fmt: tuple[str, int]) -> None:
        """The KV's conversion to the wire format `fmt` (dtype, block size: the decode workers', learned per
        request) for a compiled step shape of `tokens` slots, every layer group's size."""
        dtype, block_size = fmt
        valid = jax.ShapeDtypeStruct((1, tokens), jnp.bool_)  # [1, T]
        for size in sorted({size for _, size in self.groups}):
            k = self._kv_avals[tokens, size]
            if dtype in QUANTIZED:
                self._quantize_kv.compile(k, valid, block_size=block_size, fmt=dtype)
            else:
                self._cast.compile(k, dtype=dtype)
        self._wire_compiled.add((tokens, dtype, block_size))

    def compile_sample(self, logits: jax.ShapeDtypeStruct) -> None:
        """Sampling of the logits as the head returns them (no penalties)."""
        spec, rows = jax.ShapeDtypeStruct, logits.shape[0]
        f32, i32, u32 = (spec((rows,), t) for t in (jnp.float32, jnp.int32, jnp.uint32))
        masks = spec((rows, (logits.shape[1] + 31) // 32), jnp.int32)
        self._sample.compile(logits, f32, i32, f32, u32, i32, f32, masks)

    def compile_penalized(self, logits: jax.ShapeDtypeStruct, length: int) -> None:
        """The penalties over prompts padded to `length` at the head's logits' rows, and sampling of
        what they return."""
        spec, rows = jax.ShapeDtypeStruct, logits.shape[0]
        f32, i32 = spec((rows,), jnp.float32), spec((rows,), jnp.int32)
        penalized, = _avals(self._penalize.compile(logits, spec((rows, length), jnp.int32), i32, i32, f32, f32, f32,
                                                   spec(logits.shape, jnp.bool_)))
        if penalized != logits:  # else `compile_sample`'s
            self.compile_sample(penalized)


def _cast(a: jax.Array, dtype: str) -> jax.Array:
    return a.astype(dtype)


def _avals(compiled) -> tuple[jax.ShapeDtypeStruct, ...]:
    """What a compiled program returns, as the next program's arguments: sharded as it returns them
    over a mesh; on one device uncommitted, as arrays made from numpy (and so its outputs) are."""
    return tuple(jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding if
                                      isinstance(o.sharding, jax.sharding.NamedSharding) else None)
                 for o in jax.tree.leaves(compiled.out_info))
