"""The decode model's weights on the CPU backed by transparent huge pages (2 MiB) instead of 4 KiB pages.

A decode step on the CPU streams every weight once (about 1 GB for a 0.5B model in bf16); on 4 KiB pages
that is a TLB miss and a page walk every 4 KiB, costly inside a virtual machine (two-level walks). At
load, the memory the weights occupy is marked MADV_HUGEPAGE and collapsed into huge pages at once
(MADV_COLLAPSE, Linux 6.1+), oneDNN's prepacked weights included (their memory is found through
`torch.ops.mkldnn.data_ptr`). Weights that lie next to each other in one mapping are taken together, so
that those smaller than a huge page are covered too. Where the kernel refuses (THP set to `never`, an
older kernel, not Linux), nothing changes and the start-up log says so.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import sys

import torch
from torch import nn

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE = 2 << 20


def _madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """(first address, end address) of the tensor's memory, plain or oneDNN-packed."""
    if tensor.is_mkldnn:
        start = torch.ops.mkldnn.data_ptr(tensor)
        return start, start + torch.ops.mkldnn._nbytes(tensor)
    start = tensor.untyped_storage().data_ptr()
    return start, start + tensor.untyped_storage().nbytes()


def _mappings() -> list[tuple[int, int]]:
    """(start, end) of each of the process's memory mappings, in address order."""
    with open("/proc/self/maps") as f:
        return [tuple(int(a, 16) for a in line.split(maxsplit=1)[0].split("-")) for line in f]  # type: ignore[misc]


def huge_page_ranges(spans: list[tuple[int, int]], mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The huge-page-aligned ranges to collapse: per mapping, from the first weight's start to the last
    weight's end there (what lies between them is memory of the same process: collapsing keeps it as it
    is), cut inwards to whole huge pages. spans and mappings: (start, end) address pairs."""
    starts = [m[0] for m in mappings]
    hulls: dict[tuple[int, int], list[int]] = {}
    for start, end in spans:
        i = bisect.bisect_right(starts, start) - 1
        if i < 0 or end > mappings[i][1]:
            continue  # not inside one mapping: leave it
        hull = hulls.setdefault(mappings[i], [start, end])
        hull[0], hull[1] = min(hull[0], start), max(hull[1], end)
    ranges = []
    for start, end in sorted(hulls.values()):
        start, end = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if end > start:
            ranges.append((start, end))
    return ranges


def weights_to_huge_pages(model: nn.Module) -> tuple[int, str]:
    """Collapses the memory of the model's CPU buffers into huge pages. Returns (bytes collapsed, what
    happened, for the start-up log)."""
    if not sys.platform.startswith("linux"):
        return 0, f"huge pages: not on Linux ({sys.platform})"
    spans = [_span(t) for t in model.buffers() if t.device.type == "cpu" and t.numel()]
    madvise = _madvise()
    collapsed, refused = 0, ""
    for start, end in huge_page_ranges(spans, _mappings()):
        for advice in (MADV_HUGEPAGE, MADV_COLLAPSE):
            if madvise(start, end - start, advice) != 0:
                refused = refused or f"madvise({advice}) refused: errno {ctypes.get_errno()}"
                break
        else:
            collapsed += end - start
    if refused and not collapsed:
        return 0, f"huge pages: none ({refused}; /sys/kernel/mm/transparent_hugepage/enabled must not be never)"
    return collapsed, f"weights on huge pages: {collapsed / 2**20:.0f} MiB" + (f" ({refused} for some)" if refused else "")
