"""Tests of the benchmarks package."""
