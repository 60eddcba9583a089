"""Where pdserve keeps what it builds once per machine: models made for demos and benchmarks, JAX's
compilation cache. `$PDSERVE_CACHE`, default ~/.cache/pdserve."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def compile_cache_dir() -> Path:
    """JAX's persistent compilation cache shared by benchmarks' prefill workers (`--compilation-cache`)."""
    return cache_dir() / "jax-compilation-cache"
