"""benchmarks/gpu.py as the device runs it, on the CPU: from a bare checkout (a fresh interpreter with no pdserve
install, the carried wheels unpacked first), every stage of the dry run in its own process; a stage made to fail
or overrun leaves every earlier stage's rows in gpu.json; rows marked unverified when their checks failed."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pdserve.benchmarks.gpu import boot as gpu_boot
from pdserve.benchmarks.gpu.run import Row

ROOT = Path(__file__).resolve().parents[3]


def _probe_wheel(directory: Path, name: str = "pdserve_probe_carried", version: str = "1.0") -> Path:
    """A wheel of one module (and a .data/purelib file, as some wheels lay theirs out)."""
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{name}/__init__.py", f"__version__ = {version!r}\n")
        z.writestr(f"{name}-{version}.data/purelib/{name}_extra.py", "EXTRA = True\n")
        z.writestr(f"{name}-{version}.data/scripts/tool", "#!/bin/sh\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_wheels_unpack_as_pip_target_lays_them_out(tmp_path):
    _probe_wheel(tmp_path / "whl")
    assert gpu_boot.unpack(tmp_path / "whl", tmp_path / "site") == ["pdserve-probe-carried==1.0"]
    assert (tmp_path / "site/pdserve_probe_carried/__init__.py").exists()
    assert (tmp_path / "site/pdserve_probe_carried_extra.py").exists()  # .data/purelib at the top
    assert not (tmp_path / "site/tool").exists()  # scripts are not importable: left out
    assert (tmp_path / "site/pdserve_probe_carried-1.0.dist-info/METADATA").exists()
    _probe_wheel(tmp_path / "whl", version="2.0")
    with pytest.raises(ValueError, match="pdserve-probe-carried 1.0 and 2.0: keep one"):
        gpu_boot.unpack(tmp_path / "whl", tmp_path / "site2")


def test_only_wheels_this_interpreter_imports_are_unpacked(tmp_path):
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert gpu_boot.runs_here(Path(f"grpcio-1.85.3-{here}-{here}-manylinux2014_x86_64.whl"))
    assert not gpu_boot.runs_here(Path("grpcio-1.85.3-cp39-cp39-manylinux2014_x86_64.whl"))
    assert gpu_boot.runs_here(Path("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl"))  # stable ABI, 3.10+
    assert not gpu_boot.runs_here(Path("protobuf-7.36.2-cp399-abi3-manylinux2014_x86_64.whl"))
    assert gpu_boot.runs_here(Path("fastapi-0.165.0-py3-none-any.whl"))
    _probe_wheel(tmp_path / "whl")
    (tmp_path / "whl/native-1.0-cp39-cp39-manylinux2014_x86_64.whl").write_bytes(b"not for this python")
    assert gpu_boot.unpack(tmp_path / "whl", tmp_path / "site") == ["pdserve-probe-carried==1.0"]


def test_the_carried_wheels_pin_what_the_generated_stubs_need():
    import re

    floors = {}
    for stub in (ROOT / "proto/pdserve/v1").glob("*_pb2_grpc.py"):
        floors["grpcio"] = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", stub.read_text()).group(1)
    for pb2 in (ROOT / "proto/pdserve/v1").glob("*_pb2.py"):
        major, minor, patch = re.search(r"_runtime_version.ValidateProtobufRuntimeVersion\(\s*_runtime_version.Domain"
                                        r".PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", pb2.read_text()).groups()
        floors["protobuf"] = f"{major}.{minor}.{patch}"

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("."))

    for dist, floor in floors.items():
        assert key(gpu_boot.WHEELS[dist]) >= key(floor), (dist, floor)
    assert gpu_boot.WHEELS["grpcio-health-checking"] == gpu_boot.WHEELS["grpcio-reflection"]


def test_a_row_reads_unverified_when_a_check_it_needs_failed_or_never_ran():
    row = Row("decode bf16", "tokens/s", 90.0, 100.0, "tok/s", 0.85, "graphs", ("kernel", "graphs"))
    ok = [{"group": "kernel", "passed": True}, {"group": "graphs", "passed": True}]
    assert row.verdict(ok) == "met"
    assert Row("x", "y", 80.0, 100.0, target=0.85).verdict([]) == "MISSED"
    assert row.verdict([*ok, {"group": "graphs", "passed": False}]) == "unverified"
    assert row.verdict(ok[:1]) == "unverified"  # no graphs check ran
    assert Row("x", "y", 1.0).verdict([]) == ""


def test_a_stage_limit_names_a_stage_and_positive_seconds(capsys):
    from pdserve.benchmarks.gpu.run import _stage_limit, main

    assert _stage_limit("served=12.5") == ("served", 12.5)
    for bad in ("served", "nope=3", "served=0", "served=soon"):
        with pytest.raises(SystemExit):
            main(["--stage-limit", bad])
        assert "give STAGE=SECONDS, a stage of ceilings, correctness," in capsys.readouterr().err


def _bare_env(**extra: str) -> dict[str, str]:
    """What the device's interpreter sees: site-packages without their .pth files (so no editable pdserve),
    run with -S; nothing else."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PDSERVE_", "TRITON_"))}
    return dict(env, PYTHONPATH=os.pathsep.join(site.getsitepackages()), PYTHONUNBUFFERED="1", **extra)


@pytest.fixture(scope="module")
def bare_dry_run(tmp_path_factory):
    """`python3 benchmarks/gpu.py --dry-run` the way the device runs it: a fresh interpreter that cannot import
    pdserve (-S: the editable install's .pth unread), only the checkout on disk and the carried wheels. One run
    (about half a minute) read by the tests below: (the process, gpu.json, the output folder)."""
    tmp_path = tmp_path_factory.mktemp("gpu-dry")
    env = _bare_env()
    probe = subprocess.run([sys.executable, "-S", "-c", "import importlib.util as u; print(u.find_spec('pdserve'))"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert probe.stdout.strip() == "None"  # the interpreter itself finds no pdserve
    _probe_wheel(tmp_path / "whl")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-S", "benchmarks/gpu.py", "--device", "cpu", "--dry-run", "--out", str(out),
                          "--wheels", str(tmp_path / "whl"), "--time-limit", "480"],
                         env=env, capture_output=True, text=True, cwd=ROOT, timeout=560)
    doc = json.loads((out / "gpu.json").read_text())
    return run, doc, out


def test_dry_run_from_a_bare_checkout(bare_dry_run):
    """Every stage in its own process, each finding the carried wheels first on its path; every check passes."""
    run, doc, out = bare_dry_run
    assert run.returncode == 0, f"{doc['stages']}\n{run.stderr[-4000:]}"
    assert "versions: numpy" in run.stderr.splitlines()[0] or "versions: numpy" in run.stderr  # reported first
    assert doc["carried_wheels"] == ["pdserve-probe-carried==1.0"]
    site_dir = doc["environment"]["carried_site"]
    assert [s["stage"] for s in doc["stages"]] == ["ceilings", "correctness", "decode", "kernels", "mla",
                                                   "prefill", "handoff", "prefill-16k", "served"]
    assert all(s["status"] == "ok" and s["sys_path_first"] == site_dir for s in doc["stages"]), doc["stages"]
    groups = {c["group"] for c in doc["checks"]}
    assert all(c["passed"] for c in doc["checks"])
    assert {"kernel", "eager", "kv", "handoff", "served", "verify-kernel", "moe-kernel", "moe-grouped",
            "mla-kernel", "lora-kernel", "prefill-lora"} <= groups
    sections = {r["section"] for r in doc["rows"]}
    assert {"ceiling", "decode bf16", "decode fp8", "verify attention", "fused moe", "grouped moe", "mla decode",
            "lora bgmv", "prefill lora",
            "prefill", "kv-handoff", "served"} <= sections
    verify = [r["measure"] for r in doc["rows"] if r["section"] == "verify attention"]
    assert any("verify k=1 " in m for m in verify) and any("verify k=7 " in m for m in verify)
    prefill = [r["measure"] for r in doc["rows"] if r["section"] == "prefill"]
    assert [m.split()[1] for m in prefill] == ["S=32", "S=64", "S=128"]  # the long one after the others
    assert all(r["runner"] == "eager" for r in doc["rows"] if r["section"].startswith("decode") and r["runner"])
    assert (out / "gpu.md").read_text().count("| served |") >= 4
    assert "[served]" in (out / "gpu.log").read_text()


def test_a_failed_or_overrun_stage_leaves_the_earlier_rows(tmp_path):
    """correctness made to hang (killed at its deadline, capped by --stage-limit) and handoff to fail: gpu.json
    still holds the ceilings' rows, each failure with its stage, and the failure's traceback tail."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--dry-run", "--out", str(out),
                          "--only", "ceilings", "--only", "correctness", "--only", "handoff", "--time-limit", "240",
                          "--stage-limit", "correctness=8",  # the hang's deadline; ceilings keeps its share of 240 s
                          "--inject", "correctness=hang", "--inject", "handoff=fail", "--wheels", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert run.returncode == 1
    doc = json.loads((out / "gpu.json").read_text())
    stages = {s["stage"]: s for s in doc["stages"]}
    assert [s["stage"] for s in doc["stages"]] == ["ceilings", "correctness", "handoff"]
    assert stages["ceilings"]["status"] == "ok"
    assert stages["correctness"]["status"] == "overran" and "overran its deadline of 8 s" in stages["correctness"]["error"]
    assert stages["handoff"]["status"] == "failed"
    assert "RuntimeError: injected failure of stage handoff" in stages["handoff"]["traceback"]
    assert [r["measure"].split()[0] for r in doc["rows"] if r["stage"] == "ceilings"] == ["device", "device", "bf16"]
    assert "correctness: injected: this stage hangs" in doc["notes"]
    md = (out / "gpu.md").read_text()
    assert "| correctness | overran |" in md and "injected failure of stage handoff" in md


def test_the_dry_run_has_every_stages_rows_targets_and_checks(bare_dry_run):
    """benchmarks/gpu.py --device cpu --dry-run, run as a file (as on the device, no install): every stage of
    the H200 script at tiny sizes on this CPU (the paged kernel under Triton's interpreter when triton is
    installed), its checks passing, the JSON and markdown written, the table printed last. The CUDA graphs,
    pinned copies, fp8 matmuls and the speed targets need the GPU run itself."""
    proc, doc, out = bare_dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    measures = [r["measure"] for r in doc["rows"]]
    for b, ctx in ((1, 16), (4, 48)):
        assert f"tokens/s B={b} ctx={ctx} vs roofline" in measures and f"ms/step B={b} ctx={ctx}" in measures
    targets = {r["measure"]: r["target"] for r in doc["rows"] if r["target"] is not None}
    assert targets == {"steps/s B=1 ctx=16 vs weight-streaming floor": 0.85, "tokens/s B=4 ctx=48 vs roofline": 0.7,
                       "steps/s B=1 ctx=16 fp8 vs bf16 (fp8 weights dequantized per matmul on cpu: the format "
                       "saves memory only)": 1.0,
                       # the kernels stage (benchmarks/gpu/kernels.py): verify attention and the fused MoE
                       "verify k=3 B=2 ctx=40: single-query time / verify time (target: k + 1 tokens for <= 1.5x "
                       "one token's attention)": 1 / 1.5,
                       "batch 1 (2 of 8 experts chosen): chosen weights read vs bandwidth": 0.6,
                       "batch 1: grouped-loop time / fused time": 1.0,
                       "batch 5: grouped-loop time / fused time": 1.0,
                       # the LoRA BGMV kernels (benchmarks/gpu/lora.py, in the kernels stage)
                       "batch 16, 4 adapters of rank 16, one layer's fused matmuls: base time / mixed time through "
                       "the kernels (target: mixed <= 1.3x)": 1 / 1.3,
                       # the prefill tier's LoRA step (benchmarks/gpu/prefill_lora.py, in the prefill stage)
                       "4 prompts x 16 tokens, one step, 4 adapters of ranks 8/16 (2-layer tiny llama): base time / "
                       "mixed time (target: mixed <= 1.3x)": 1 / 1.3}
    assert any(r["section"] == "kv-handoff" for r in doc["rows"]) and any(r["section"] == "prefill" for r in doc["rows"])
    names = [c["name"] for c in doc["checks"]]
    assert all(c["passed"] for c in doc["checks"]), doc["checks"]
    assert "received KV written bit-exactly (100 tokens, 7 scattered blocks)" in names
    assert any(n.startswith("greedy tokens = transformers' (cpu, eager") for n in names)
    assert all(r["value"] > 0 for r in doc["rows"])
    checks_table = (out / "gpu.md").read_text().split("| check | group | result | detail |")[1]  # after the stages'
    assert checks_table.count("| ok |") == len(names)
    assert proc.stdout.splitlines()[0].split()[:2] == ["section", "measure"]  # the table is printed last, alone


def test_the_tiny_llama_and_its_greedy_tokens_are_made_once_per_run(tmp_path, monkeypatch):
    """The correctness stage makes the checkpoint and transformers' tokens; the served stage (another process)
    reads both: one checkpoint per run folder, one reference per (prompts, tokens, device type)."""
    from pdserve.benchmarks.gpu import checks as gpu_checks
    from pdserve.server.model import tiny

    made, generated = [], []
    monkeypatch.setattr(tiny, "make_tiny_model", lambda path, family: made.append(family) or
                        (path / "config.json").write_text("{}"))
    monkeypatch.setattr(gpu_checks, "_hf_greedy", lambda path, prompts, n, device: generated.append(device.type) or
                        [[7] * n for _ in prompts])
    path = gpu_checks.tiny_llama(tmp_path)
    assert path == tmp_path / "tiny-llama" and (path / "config.json").exists()
    assert gpu_checks.tiny_llama(tmp_path) == path and made == ["llama"]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-llama"]  # made aside, then renamed whole
    assert gpu_checks.hf_greedy(path, [[1, 2], [3]], 2) == [[7, 7], [7, 7]]
    assert gpu_checks.hf_greedy(path, [[1, 2], [3]], 2, "cpu") == [[7, 7], [7, 7]] and generated == ["cpu"]
    assert gpu_checks.hf_greedy(path, [[1, 2], [3]], 3) == [[7, 7, 7], [7, 7, 7]] and generated == ["cpu", "cpu"]
    assert gpu_checks.hf_greedy(path, [[1, 2], [3]], 2, "meta") == [[7, 7], [7, 7]]  # another device: its own
    assert generated == ["cpu", "cpu", "meta"]
    assert sorted(p.name for p in path.glob("greedy-*.json")) == ["greedy-cpu.json", "greedy-meta.json"]
