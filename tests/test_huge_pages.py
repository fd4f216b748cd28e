"""empty_on_huge_pages: a usable tensor of the asked shape, its bytes on a huge page
boundary where the kernel can be asked for huge pages."""

from __future__ import annotations

import sys

import torch

from engine.model.startup.huge_pages import HUGE_PAGE, empty_on_huge_pages


def test_a_large_tensor_starts_on_a_huge_page_and_holds_its_values() -> None:
    t = empty_on_huge_pages((3, HUGE_PAGE // 4 + 5), torch.float32)
    assert t.shape == (3, HUGE_PAGE // 4 + 5) and t.dtype == torch.float32
    assert t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view(t.shape))
    assert t[2, -1].item() == t.numel() - 1


def test_a_small_tensor_is_a_plain_one() -> None:
    t = empty_on_huge_pages((4, 4), torch.bfloat16)
    assert t.shape == (4, 4) and t.dtype == torch.bfloat16 and t.is_contiguous()
