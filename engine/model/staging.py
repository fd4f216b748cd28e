"""Host values to the device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises
with the stream: the host would wait for every kernel already queued (with async
scheduling, the whole step in flight). Staging the values in pinned memory lets the
copy queue behind that work instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`values` as a tensor on `device`; on CUDA an asynchronous copy from pinned memory."""
    if device.type != "cuda":
        if isinstance(values, torch.Tensor):
            return values.to(device=device, dtype=dtype)
        return torch.tensor(values, dtype=dtype, device=device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    # The caching host allocator keeps `host` alive until the copy has run.
    return host.to(device, non_blocking=True)
