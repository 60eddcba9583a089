"""The capability probe (server/hardware.py): ISA read from /proc/cpuinfo, capped by PDSERVE_CPU_ISA, handed
to oneDNN, ATen and XLA; each CPU family named as benchmarks compare them."""

from __future__ import annotations

import platform

import pytest

from pdserve.server import hardware

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 sha_ni
processor\t: 1
model name\t: AMD EPYC 7B12
flags\t\t: fpu avx512f
"""
SAPPHIRE_RAPIDS = """model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: sse4_2 avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 \
amx_bf16 amx_tile amx_int8 avx_vnni
"""
SKYLAKE = "model name\t: Intel(R) Xeon(R) CPU @ 2.00GHz\nflags\t\t: avx fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes sha2 crc32 sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes\n"


def test_the_first_processors_flags_name_the_family():
    avx2 = hardware.read_cpu(EPYC_AVX2, "x86_64", cap="")
    assert avx2.model == "AMD EPYC 7B12" and avx2.family == "x86_64/avx2"
    assert avx2.has("avx2", "fma") and not avx2.avx512 and not avx2.native_bf16  # processor 1's flags ignored
    amx = hardware.read_cpu(SAPPHIRE_RAPIDS, "x86_64", cap="")
    assert amx.family == "x86_64/amx-bf16" and amx.avx512 and amx.native_bf16
    skylake = hardware.read_cpu(SKYLAKE, "x86_64", cap="")
    assert skylake.family == "x86_64/avx512" and skylake.avx512 and not skylake.native_bf16
    assert hardware.read_cpu(GRAVITON3, "aarch64", cap="").family == "aarch64/sve-bf16"
    assert hardware.read_cpu(GRAVITON3, "aarch64", cap="").native_bf16
    assert hardware.read_cpu(GRAVITON2, "aarch64", cap="").family == "aarch64/neon"
    assert hardware.read_cpu("", "x86_64", cap="").family == "x86_64/sse"  # no flags: no fast path assumed


@pytest.mark.parametrize("cap, family, kept, gone", [
    ("avx2", "x86_64/avx2", {"avx2", "fma"}, {"avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"}),
    ("avx512", "x86_64/avx512", {"avx512bw", "avx512_vnni"}, {"avx512_bf16", "amx_tile"}),
    ("avx512_bf16", "x86_64/avx512-bf16", {"avx512_bf16"}, {"amx_bf16", "amx_int8", "avx512_fp16"}),
    ("amx", "x86_64/amx-bf16", {"amx_bf16", "avx512_fp16"}, set()),
])
def test_a_cap_removes_every_feature_above_it(cap, family, kept, gone):
    c = hardware.read_cpu(SAPPHIRE_RAPIDS, "x86_64", cap=cap)
    assert c.family == family and c.cap == cap
    assert kept <= c.features and not gone & c.features
    assert f"capped at {cap} by PDSERVE_CPU_ISA" in c.describe()


def test_a_cap_this_architecture_cannot_take_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=r"PDSERVE_CPU_ISA='sse9': takes one of avx2, avx512, avx512_bf16, amx"):
        hardware.read_cpu(SKYLAKE, "x86_64", cap="sse9")
    with pytest.raises(ValueError, match="this machine is aarch64"):
        hardware.read_cpu(GRAVITON3, "aarch64", cap="avx2")


def test_the_cap_reaches_onednn_aten_and_xla_and_keeps_what_the_user_set():
    env = {"PDSERVE_CPU_ISA": "avx2", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert hardware.apply_cpu_cap(env) == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"
    env = {"PDSERVE_CPU_ISA": "avx512_bf16", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    hardware.apply_cpu_cap(env)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX512_BF16"
    assert hardware.apply_cpu_cap({}) is None


def test_this_machine_is_probed_and_described():
    c = hardware.cpu()
    assert c.arch == platform.machine() and c.family.startswith(c.arch)
    caps = hardware.torch_probe()
    if c.arch == "x86_64" and not c.avx512 and not c.has("avx_ne_convert"):
        assert not caps.onednn_bf16  # what the reorder needs is missing (or capped away)
    found = hardware.Hardware(cpu=c, torch=caps, paths={"matmuls": "fp32"})
    line = found.describe()
    assert line.startswith(f"cpu {c.model} ({c.family}") and "oneDNN bf16" in line and line.endswith("matmuls: fp32")
    info = found.to_proto()
    assert info.cpu_family == c.family and info.framework == f"torch {caps.version}" and info.devices == "cpu"
    assert dict(info.paths) == {"matmuls": "fp32"} and list(info.cpu_features) == sorted(c.features)
    assert hardware.machine_record()["family"] == c.family


def test_the_jax_probe_names_the_backend():
    caps = hardware.jax_probe()
    found = hardware.Hardware(cpu=hardware.cpu(), jax=caps, device=caps.backend)
    assert caps.backend == "cpu" and caps.devices >= 1
    assert found.to_proto().devices.startswith(f"{caps.devices} cpu")
