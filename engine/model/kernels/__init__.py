"""Triton kernels: paged attention, prefill attention, one-row GEMV."""
