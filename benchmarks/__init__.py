"""Benchmarks: the tier benchmarks (`python -m pdserve.benchmarks.tiers`) beside this machine's ceilings.

By subject: `engine/` (one tier's engine in process), `kv/` (the KV handoff), `load/` (served systems under
load, vLLM beside), `hostile/` (bad input at every port), `gpu/` (the GPU run, `python3 benchmarks/gpu.py`),
`plan/` (`pdserve plan profile` and `validate`), `published/` (figures of record). What several of them share
stays here: `bench.py` (`pdserve bench`), `clients.py`, `servers.py`, `checkpoint.py`, `protocol.py`,
`metrics.py`, `report.py`, `ceilings.py`, `paths.py`, `compare.py` (any two runs' JSON)."""
