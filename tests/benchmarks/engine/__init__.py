"""Tests of benchmarks/engine/."""
