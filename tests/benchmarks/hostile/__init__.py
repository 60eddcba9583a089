"""Tests of benchmarks/hostile/."""
