"""Benchmarks: the tier benchmarks (`python -m pdserve.benchmarks.tiers`) beside this machine's ceilings."""
