"""What the one-GPU benchmarks do between timed parts: wait for the device, free memory."""

from __future__ import annotations

import gc

import torch


def sync(device: torch.device) -> None:
    """Wait until the device has finished its queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Give back what the last part held, so the next one starts from the same memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
