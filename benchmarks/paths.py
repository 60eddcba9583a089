"""Where the benchmarks find the checkout they run from, and where their results go by default."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout (the folder holding benchmarks/, server/, .venv-vllm/)."""

RESULTS = ROOT / "benchmarks" / "results"
"""Each benchmark's default output folder is a folder of this one (ignored by git)."""

EMBEDDED_MODEL = ROOT / "server" / "model" / "default"
"""The tiny Llama embedded in the server (`pdserve up` with no --model serves it)."""
