"""The decode model's weights on the CPU backed by transparent huge pages (2 MiB) instead of 4 KiB pages.

A decode step on the CPU streams every weight once (about 1 GB for a 0.5B model in bf16); on 4 KiB pages
that is a TLB miss and a page walk every 4 KiB, costly inside a virtual machine (two-level walks). At
load, each weight's memory is marked MADV_HUGEPAGE and collapsed into huge pages at once (MADV_COLLAPSE,
Linux 6.1+), oneDNN's prepacked weights included (their memory is found through
`torch.ops.mkldnn.data_ptr`). Where the kernel refuses (THP set to `never`, an older kernel, not Linux),
nothing changes and the start-up log says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch
from torch import nn

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE
"""Smaller tensors cannot fill a huge page of their own."""


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the tensor's memory, plain or oneDNN-packed."""
    if tensor.is_mkldnn:
        return torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor)
    return tensor.data_ptr(), tensor.untyped_storage().nbytes()


def weights_to_huge_pages(model: nn.Module) -> tuple[int, str]:
    """Collapses the memory of every CPU buffer of at least MIN_BYTES into huge pages. Returns (bytes in
    huge-page-aligned ranges that the kernel collapsed, what happened, for the start-up log)."""
    madvise = _madvise()
    if madvise is None:
        return 0, f"huge pages: not on Linux ({sys.platform})"
    tensors = [t for t in model.buffers() if t.device.type == "cpu"]
    collapsed, refused = 0, ""
    for tensor in tensors:
        address, nbytes = _span(tensor)
        if nbytes < MIN_BYTES:
            continue
        start = -(-address // HUGE_PAGE) * HUGE_PAGE  # whole huge pages inside the tensor's memory
        end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end <= start:
            continue
        for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if madvise(start, end - start, advice) != 0:
                refused = refused or f"madvise({advice}) refused: errno {ctypes.get_errno()}"
                break
        else:
            collapsed += end - start
    if refused and not collapsed:
        return 0, f"huge pages: none ({refused}; /sys/kernel/mm/transparent_hugepage/enabled must not be never)"
    return collapsed, f"huge pages: {collapsed / 2**20:.0f} MiB of weights" + (f" ({refused} for some)" if refused else "")
