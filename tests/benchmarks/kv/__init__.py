"""Tests of benchmarks/kv/."""
