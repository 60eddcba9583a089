"""Benchmarks: the tier benchmarks (`python -m benchmarks.tiers`) beside this machine's ceilings."""
