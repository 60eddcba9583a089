"""What this machine computes with, probed once per process at start; the tiers choose kernels from it.

1. `cpu()`: the CPU's instruction sets from /proc/cpuinfo (x86-64: AVX2, AVX-512 F/BW/VL/DQ, AVX512-bf16,
   AVX512-fp16, AVX-NE-convert, AMX; aarch64: NEON (asimd), SVE, bf16, i8mm), capped by `PDSERVE_CPU_ISA`.
2. `apply_cpu_cap()`, first thing in every pdserve process: a cap (`PDSERVE_CPU_ISA=avx2|avx512|avx512_bf16|amx`)
   is handed on to oneDNN (`ONEDNN_MAX_CPU_ISA`), ATen (`ATEN_CPU_CAPABILITY`), MKL (`MKL_ENABLE_INSTRUCTIONS`)
   and XLA (`--xla_cpu_max_isa`),
   so the kernels under pdserve see the machine pdserve chose for: a machine with AVX-512 or AMX runs as
   an AVX2-only one would, and every fallback is testable anywhere.
3. `torch_probe()` (decode tier) and `jax_probe()` (prefill tier): what the frameworks will run here: ATen's
   dispatch level, whether oneDNN runs a bf16/fp16 linear (tried on a small input, not inferred), CUDA
   devices and their compute capability, Triton; JAX's backend and devices.
4. `Hardware.describe()` is the start-up line, `Hardware.as_dict()` goes into the worker's info
   (`pdserve status`) and every benchmark's machine record; `family` names what runs are comparable.

No jax or torch at import: the coordinator and `kvcache/` import neither.
"""

from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

CAP_ENV = "PDSERVE_CPU_ISA"
X86_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
"""The caps PDSERVE_CPU_ISA takes on x86-64, oldest first."""
_ABOVE: dict[str, frozenset[str]] = {
    # what each level adds to the one before it (the features a cap at the level below removes)
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512ifma",
                         "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "avx512_vp2intersect",
                         "avx_vnni"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
    "amx": frozenset({"amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "avx512_fp16", "avx_ne_convert",
                      "avx_vnni_int8", "avx_vnni_int16"}),
}
_CAP_FOR_ONEDNN = {"avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}
_CAP_FOR_ATEN = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512", "amx": "avx512"}
_CAP_FOR_MKL = {"avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512", "amx": "AVX512_E4"}
_CAP_FOR_XLA = {"avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512_BF16", "amx": "AMX"}
KEY_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
                "avx512_fp16", "avx_ne_convert", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                "asimd", "sve", "sve2", "bf16", "i8mm")
"""The features that choose kernels (the others /proc/cpuinfo lists are kept out of logs and records)."""


@dataclass(frozen=True)
class Cpu:
    arch: str
    """platform.machine(): x86_64, aarch64, ..."""
    model: str
    features: frozenset[str]
    """The kernel-choosing features present (KEY_FEATURES), after the cap."""
    cap: str | None = None
    """PDSERVE_CPU_ISA when set: the features above it are treated as absent."""

    def has(self, *names: str) -> bool:
        return all(n in self.features for n in names)

    @property
    def avx512(self) -> bool:
        """AVX-512 F/BW/VL/DQ: what oneDNN's bf16 reorder and ATen's avx512 kernels need."""
        return self.has("avx512f", "avx512bw", "avx512vl", "avx512dq")

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-bf16, AMX-bf16, AVX-NE-convert; ARM's bf16): a bf16 matmul
        at least as fast as fp32's, at half the weight bytes."""
        return self.has("avx512_bf16") or self.has("amx_bf16") or self.has("avx_ne_convert") or \
            (self.arch == "aarch64" and self.has("bf16"))

    @property
    def family(self) -> str:
        """What benchmark figures may be compared across: the architecture and its widest kernel tier."""
        if self.arch == "x86_64":
            for name, test in (("amx-bf16", self.has("amx_bf16")), ("avx512-bf16", self.avx512 and self.has("avx512_bf16")),
                               ("avx512", self.avx512), ("avx2", self.has("avx2"))):
                if test:
                    return f"x86_64/{name}"
            return "x86_64/sse"
        if self.arch == "aarch64":
            extras = [n for n in ("sve", "bf16") if self.has(n)]
            return "aarch64/" + ("-".join(extras) if extras else "neon")
        return self.arch

    def describe(self) -> str:
        capped = f", capped at {self.cap} by {CAP_ENV}" if self.cap else ""
        shown = [f for f in KEY_FEATURES if f in self.features]
        return f"{self.model} ({self.family}{capped}: {' '.join(shown) or 'none of ' + ' '.join(KEY_FEATURES[:3])})"


def _cpuinfo_features(text: str) -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo's first processor (x86 'flags', ARM 'Features')."""
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def read_cpu(cpuinfo: str | None = None, arch: str | None = None, cap: str | None = None) -> Cpu:
    """The CPU from /proc/cpuinfo (or the text given), capped at `cap` (default: $PDSERVE_CPU_ISA)."""
    arch = arch or platform.machine()
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no flags, so no fast path is assumed
            cpuinfo = ""
    model, flags = _cpuinfo_features(cpuinfo)
    cap = os.environ.get(CAP_ENV) or None if cap is None else cap or None
    features = {f for f in KEY_FEATURES if f in flags}
    if cap is not None:
        if arch != "x86_64" or cap not in X86_LEVELS:
            raise ValueError(f"{CAP_ENV}={cap!r}: takes one of {', '.join(X86_LEVELS)} on x86_64 "
                             f"(this machine is {arch}); unset it to use everything the CPU has")
        for level in X86_LEVELS[X86_LEVELS.index(cap) + 1:]:
            features -= _ABOVE[level]
    return Cpu(arch=arch, model=model or platform.processor() or arch, features=frozenset(features), cap=cap)


@functools.cache
def cpu() -> Cpu:
    """This process's CPU, read once."""
    return read_cpu()


def apply_cpu_cap(environ: dict[str, str] | None = None) -> str | None:
    """Hands PDSERVE_CPU_ISA to oneDNN, ATen and XLA (before either framework starts; what is set
    already is kept). Returns the cap, or None. Raises ValueError for a cap this CPU cannot take."""
    env = os.environ if environ is None else environ
    cap = env.get(CAP_ENV) or None
    if cap is None:
        return None
    read_cpu(cpuinfo="", cap=cap)  # validates the cap's name for this architecture
    env.setdefault("ONEDNN_MAX_CPU_ISA", _CAP_FOR_ONEDNN[cap])
    env.setdefault("ATEN_CPU_CAPABILITY", _CAP_FOR_ATEN[cap])
    env.setdefault("MKL_ENABLE_INSTRUCTIONS", _CAP_FOR_MKL[cap])  # torch's fp32 gemm
    xla = env.get("XLA_FLAGS", "")
    if "--xla_cpu_max_isa" not in xla:
        env["XLA_FLAGS"] = f"{xla} --xla_cpu_max_isa={_CAP_FOR_XLA[cap]}".strip()
    return cap


@dataclass(frozen=True)
class TorchCaps:
    version: str
    aten_cpu: str
    """ATen's CPU dispatch level (DEFAULT, AVX2, AVX512, ...), after ATEN_CPU_CAPABILITY."""
    onednn_bf16: bool
    """oneDNN prepacks and runs a bf16 linear here (tried, and checked against fp32)."""
    onednn_fp16: bool
    onednn_fp32: bool = False
    """oneDNN prepacks and runs an fp32 linear here."""
    int8_cpu: bool = False
    """torch's weight-only int8 kernel (`_weight_int8pack_mm`) runs on this CPU (tried, checked)."""
    cuda: tuple[tuple[str, tuple[int, int]], ...] = ()
    """(name, compute capability) of each CUDA device torch sees."""
    triton: bool = False

    @property
    def fp8_matmul(self) -> bool:
        """A CUDA device of compute capability 8.9+ (Ada, Hopper, Blackwell): torch._scaled_mm's fp8."""
        return any(cc >= (8, 9) for _, cc in self.cuda)


def _int8_runs() -> bool:
    """Whether torch's weight-only int8 CPU kernel runs here and agrees with the dequantized matmul."""
    import torch

    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(-127, 128, (32, 64), generator=g, dtype=torch.int8)
        scale, x = torch.rand(32, generator=g) / 64, torch.randn(3, 64, generator=g)
        y = torch._weight_int8pack_mm(x, q, scale)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    want = x @ (q.float() * scale[:, None]).t()
    return bool(((y - want).abs().max() <= 1e-3 * want.abs().max() + 1e-4).item())


def _onednn_runs(dtype) -> bool:
    """Whether oneDNN reorders and runs a linear in dtype on this CPU, agreeing with fp32 (a tiny trial)."""
    import torch

    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)
        y = torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "").float()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    want = x.to(dtype).float() @ w.to(dtype).float().t()
    return bool(((y - want).abs().max() <= 0.05 * want.abs().max() + 1e-2).item())


@functools.cache
def torch_probe() -> TorchCaps:
    """What torch runs here (imports torch; the decode tier's start-up calls it once)."""
    import importlib.util

    import torch

    cap = cpu().cap
    onednn_bf16 = _onednn_runs(torch.bfloat16) and (cap is None or cpu().avx512 or cpu().has("avx_ne_convert"))
    onednn_fp16 = _onednn_runs(torch.float16) and (cap is None or cpu().has("avx512_fp16") or cpu().has("amx_fp16"))
    cuda = tuple((torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
                 for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
    return TorchCaps(version=torch.__version__, aten_cpu=torch.backends.cpu.get_cpu_capability(),
                     onednn_bf16=onednn_bf16, onednn_fp16=onednn_fp16, onednn_fp32=_onednn_runs(torch.float32), int8_cpu=_int8_runs(), cuda=cuda,  # type: ignore[arg-type]
                     triton=importlib.util.find_spec("triton") is not None)


@dataclass(frozen=True)
class JaxCaps:
    version: str
    backend: str
    """cpu | gpu | tpu: the platform JAX computes on."""
    device_kind: str
    devices: int


def jax_probe() -> JaxCaps:
    """What JAX runs on here (imports jax; the prefill tier's start-up calls it once)."""
    import jax

    devices = jax.devices()
    return JaxCaps(version=jax.__version__, backend=jax.default_backend(),
                   device_kind=devices[0].device_kind if devices else "", devices=len(devices))


@dataclass(frozen=True)
class Hardware:
    """One process's machine and what its framework runs there; `paths` the kernels it chose."""

    cpu: Cpu
    torch: TorchCaps | None = None
    jax: JaxCaps | None = None
    device: str = "cpu"
    """Where the worker computes: cpu, cuda:0 (torch); the JAX backend's devices."""
    paths: dict[str, str] = field(default_factory=dict)
    """What each choice came to, e.g. {"matmuls": "bf16 weights -> fp32 compute (no native bf16 ...)"}."""

    def describe(self) -> str:
        parts = [f"cpu {self.cpu.describe()}"] + ([f"device {self.devices()}"] if self.device != "cpu" else [])
        if self.torch is not None:
            t = self.torch
            parts.append(f"torch {t.version} (ATen {t.aten_cpu}, oneDNN bf16 {'yes' if t.onednn_bf16 else 'no'}, "
                         f"fp32 {'yes' if t.onednn_fp32 else 'no'}"
                         + "".join(f", {name} sm_{a}{b}" for name, (a, b) in t.cuda)
                         + (f", triton {'yes' if t.triton else 'no'}" if t.cuda else "") + ")")
        if self.jax is not None:
            parts.append(f"jax {self.jax.version} on {self.jax.devices} {self.jax.backend} device(s) "
                         f"({self.jax.device_kind})")
        parts += [f"{what}: {how}" for what, how in self.paths.items()]
        return "; ".join(parts)

    def to_proto(self):
        """As WorkerInfo.hardware."""
        from pdserve.v1 import worker_pb2 as pb

        framework = f"torch {self.torch.version}" if self.torch else f"jax {self.jax.version}" if self.jax else ""
        return pb.Hardware(cpu_model=self.cpu.model, cpu_family=self.cpu.family,
                           cpu_features=sorted(self.cpu.features), cpu_cap=self.cpu.cap or "", framework=framework,
                           devices=self.devices(), paths=self.paths, summary=self.describe())

    def devices(self) -> str:
        if self.jax is not None:
            return f"{self.jax.devices} {self.jax.backend} ({self.jax.device_kind})"
        if self.torch is not None and self.device.startswith("cuda") and self.torch.cuda:
            index = int(self.device.partition(":")[2] or 0)
            name, (major, minor) = self.torch.cuda[min(index, len(self.torch.cuda) - 1)]
            return f"{self.device} ({name}, sm_{major}{minor})"
        return self.device

    def as_dict(self) -> dict:
        out = asdict(self)
        out["cpu"]["features"] = sorted(self.cpu.features)
        out["cpu"]["family"] = self.cpu.family
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


def machine_record() -> dict:
    """The CPU part of a benchmark's machine record (no framework imported)."""
    c = cpu()
    return {"arch": c.arch, "cpu_model": c.model, "family": c.family, "features": sorted(c.features), "cap": c.cap}
