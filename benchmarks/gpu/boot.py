"""Start-up from a bare checkout on the device: what its image lacks, carried as wheels; the `pdserve` package
found in the checkout itself (nothing installed); the version and place of everything the run imports.

The device image (torch 2.11 + CUDA 13, JAX 0.11, Triton, transformers, prometheus-client, uvloop, an older
grpcio 1.84) reaches no package registry. What pdserve needs beyond it travels with the command as the exact
wheels of `WHEELS` (~13 MB of the 64 MiB a run may carry), downloaded here first:

    python benchmarks/gpu/boot.py download               # here: pip download the wheels into .whl/ (ignored)
    run(command="python3 benchmarks/gpu.py --out $OUT", carry=[".whl"])   # there

`benchmarks/gpu.py` calls `carry(.whl)` before it imports anything else: every wheel is unpacked (a wheel is a
zip of what site-packages gets) into a temporary directory put first on sys.path, and on PYTHONPATH for the
processes it starts, so the carried grpcio/protobuf win over the image's. `python benchmarks/gpu/boot.py cli
ARGS` runs `pdserve ARGS` from the checkout (the served pair's workers and coordinator).

Standard library only: it runs before anything is importable.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout."""

WHEELS: dict[str, str] = {
    # the wire: the generated stubs need grpcio >= 1.85.1 and protobuf >= 7.35.1 (they check at import)
    "grpcio": "1.85.3",
    "grpcio-health-checking": "1.85.1",
    "grpcio-reflection": "1.85.1",
    "protobuf": "7.36.2",
    # the coordinator (the served pair): its HTTP fronts and the KServe stubs are imported at its start
    "fastapi": "0.165.0",
    "starlette": "1.10.0",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "annotated-doc": "0.0.7",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
    "opentelemetry-api": "1.45.2",
    "uvicorn": "0.54.0",
    "tritonclient": "2.69.0",
    "python-rapidjson": "1.25",
}
"""Distribution -> the exact version carried (the versions this repository's CPU tests run)."""

MODULES: dict[str, str] = {
    "numpy": "numpy", "ml_dtypes": "ml_dtypes", "torch": "torch", "triton": "triton", "jax": "jax",
    "jaxlib": "jaxlib", "transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers",
    "grpc": "grpcio", "google.protobuf": "protobuf", "grpc_health": "grpcio-health-checking",
    "grpc_reflection": "grpcio-reflection", "prometheus_client": "prometheus-client", "uvloop": "uvloop",
    "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic", "uvicorn": "uvicorn",
    "tritonclient": "tritonclient", "jinja2": "jinja2", "tqdm": "tqdm",
}
"""Module -> its distribution: what the run imports, reported first thing."""

REQUIRED = ("numpy", "ml_dtypes", "torch", "grpc", "google.protobuf", "grpc_health", "prometheus_client")
"""Without these no stage runs (the others each take a stage down, which says so)."""

CARRIED_ENV = "PDSERVE_CARRIED_SITE"
"""Set to the unpacked wheels' directory by `carry`: a child process finds them on PYTHONPATH already."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def checkout_package(root: Path = ROOT) -> None:
    """Makes `import pdserve` find the checkout when nothing installed it: `pdserve` is proto/pdserve (the
    generated wire code, `pdserve.v1`), its subpackages (`pdserve.server`, `pdserve.kvcache`,
    `pdserve.benchmarks`) the checkout's folders of those names, as pyproject.toml maps them."""
    if "pdserve" in sys.modules or importlib.util.find_spec("pdserve") is not None:
        return
    spec = importlib.util.spec_from_file_location("pdserve", root / "proto/pdserve/__init__.py",
                                                  submodule_search_locations=[str(root / "proto/pdserve"), str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pdserve"] = module
    spec.loader.exec_module(module)


def _dist(wheel: Path) -> tuple[str, str]:
    """(normalized distribution name, version) from a wheel's file name."""
    name, version = wheel.name.split("-")[:2]
    return re.sub(r"[-_.]+", "-", name).lower(), version


def runs_here(wheel: Path) -> bool:
    """Whether this interpreter can import the wheel: pure Python, or built for this CPython (cpXY), or for
    its stable ABI (cpXY-abi3, XY at most this one's)."""
    python, abi = wheel.name[:-4].split("-")[-3:-1]
    here = sys.version_info[0] * 100 + sys.version_info[1]
    built = [int(t[2:3]) * 100 + int(t[3:]) for t in python.split(".") if re.fullmatch(r"cp\d{2,3}", t)]
    if not built:
        return True  # py3 / py2.py3
    return any(b == here or (abi == "abi3" and b <= here) for b in built)


def unpack(wheel_dir: Path, target: Path) -> list[str]:
    """Every wheel in wheel_dir this interpreter can import (`runs_here`: a cp312 wheel is left out under 3.11)
    unpacked into target as pip --target lays it out (a `.data/purelib|platlib` folder's contents at the top,
    its scripts and headers left out) -> ["name==version", ...]. Two versions of one distribution are refused."""
    wheels = sorted(w for w in Path(wheel_dir).glob("*.whl") if runs_here(w))
    seen: dict[str, str] = {}
    for wheel in wheels:
        name, version = _dist(wheel)
        if name in seen:
            raise ValueError(f"{wheel_dir} holds {name} {seen[name]} and {version}: keep one")
        seen[name] = version
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if info.is_dir() or not parts[-1]:
                    continue
                dest = target.joinpath(*parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(info))
                if info.external_attr >> 16 & 0o111:
                    dest.chmod(0o755)
    return [f"{n}=={v}" for n, v in seen.items()]


def carry(wheel_dir: Path | None) -> tuple[Path | None, list[str]]:
    """The carried wheels first on sys.path (and PYTHONPATH, for child processes) -> (their directory, the
    distributions); the directory is removed when this process exits. A child of a process that carried them
    finds them on PYTHONPATH: nothing to do. No directory, or no wheel in it: (None, [])."""
    done = os.environ.get(CARRIED_ENV)
    if done:
        return Path(done), []
    if wheel_dir is None or not Path(wheel_dir).is_dir() or not any(Path(wheel_dir).glob("*.whl")):
        return None, []
    target = Path(tempfile.mkdtemp(prefix="pdserve-carried-"))
    atexit.register(shutil.rmtree, target, ignore_errors=True)  # the children that read it end first
    dists = unpack(Path(wheel_dir), target)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    os.environ[CARRIED_ENV] = str(target)
    return target, dists


def versions(modules: dict[str, str] = MODULES) -> dict[str, str]:
    """Module -> "version (where it was found)" or "missing (why)", each module imported here."""
    out = {}
    for module, dist in modules.items():
        try:
            m = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - reported, not raised: a missing module takes its stage down
            out[module] = f"missing ({type(e).__name__}: {str(e)[:160]})"
            continue
        version = getattr(m, "__version__", None)
        if not isinstance(version, str):
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                version = "?"
        where = Path(getattr(m, "__file__", None) or next(iter(getattr(m, "__path__", [])), "?")).parent
        out[module] = f"{version} ({where})"
    return out


def download(dest: Path, python_version: str = "3.12") -> int:
    """pip download of `WHEELS` for the device (CPython python_version, x86-64 manylinux) into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *platforms, "-d", str(dest),
           *(f"{n}=={v}" for n, v in WHEELS.items())]
    code = subprocess.call(cmd)
    if code == 0:
        size = sum(w.stat().st_size for w in dest.glob("*.whl"))
        print(f"{len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}: carry it (carry=['.whl'])")
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["download"]:
        return download(Path(argv[1]) if len(argv) > 1 else ROOT / ".whl")
    if argv[:1] == ["cli"]:  # pdserve's CLI from the checkout, the carried wheels found on PYTHONPATH
        checkout_package()
        from pdserve.server.cli import main as pdserve_main

        return pdserve_main(argv[1:])
    if argv[:1] == ["versions"]:
        carry(ROOT / ".whl")
        for module, version in versions().items():
            print(f"{module}: {version}")
        return 0
    print("usage: benchmarks/gpu/boot.py download [DIR] | cli PDSERVE_ARGS... | versions", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main())
