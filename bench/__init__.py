"""Benchmarks: offline throughput and gRPC load generation."""
