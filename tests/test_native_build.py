"""The C kernels come prebuilt where there is no compiler (the images' runtime stage), or are compiled once into
the kernel cache: the fused MoE kernel found in $PDSERVE_PREBUILT_KERNELS loads and computes what the loop does."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from pdserve.server import hardware, native_build
from pdserve.server.decode import cpu_moe_kernel

SSE = hardware.read_cpu("model name : old\nflags : sse2\n", "x86_64", cap="")
AVX512 = hardware.read_cpu("model name : new\nflags : avx2 fma avx512f avx512bw avx512vl avx512dq\n", "x86_64", cap="")


def test_variants_run_from_the_best_this_cpu_has_down_to_the_baseline():
    assert native_build.isa_variants(AVX512) == [["-march=x86-64-v4", "-mprefer-vector-width=512"],
                                                 ["-march=x86-64-v3"], []]
    assert native_build.isa_variants(SSE) == [[]]
    arm = hardware.read_cpu("Features : asimd\n", "aarch64", cap="")
    assert native_build.isa_variants(arm) == [["-mcpu=native"], []]


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    out = tmp_path_factory.mktemp("prebuilt")
    done = subprocess.run([sys.executable, "-m", "pdserve.server.native_build", "--prebuild", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return out


def test_prebuild_builds_every_variant_this_architecture_runs(prebuilt):
    names = sorted(p.name for p in prebuilt.iterdir())
    expected = sorted(cpu_moe_kernel.SOURCE.library_name(f) for f in native_build.isa_variants(AVX512)
                      if not any("native" in x for x in f))
    assert names == expected


def test_without_a_compiler_the_prebuilt_library_for_this_cpu_is_loaded(prebuilt, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(native_build.PREBUILT_ENV, str(prebuilt))
    path, how = native_build.build(cpu_moe_kernel.SOURCE)
    assert path.parent == prebuilt and how.startswith("prebuilt")
    assert path.name == cpu_moe_kernel.SOURCE.library_name(native_build.isa_variants(hardware.cpu())[0])
    assert not (tmp_path / "cache").exists()  # nothing compiled
    assert ctypes.CDLL(str(path)).moe_panel_width() in (32, 64)
    # an older CPU takes the baseline library
    assert native_build.build(cpu_moe_kernel.SOURCE, SSE)[0].name == cpu_moe_kernel.SOURCE.library_name([])


def test_without_a_compiler_or_a_prebuilt_library_the_message_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv(native_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(native_build.PREBUILT_ENV, str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="install gcc or clang.*--prebuild DIR"):
        native_build.build(cpu_moe_kernel.SOURCE)


def test_a_changed_source_is_another_library(tmp_path):
    src = tmp_path / "k.c"
    src.write_text("int f(void) { return 1; }\n")
    a = native_build.NativeSource(src).library_name([])
    src.write_text("int f(void) { return 2; }\n")
    assert native_build.NativeSource(src).library_name([]) != a
