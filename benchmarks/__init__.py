"""Benchmark scripts (tables, not tests): codec throughput, rate/distortion, CUDA checks."""
