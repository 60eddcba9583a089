"""Tests of benchmarks/gpu/."""
