"""Tests of benchmarks/load/."""
