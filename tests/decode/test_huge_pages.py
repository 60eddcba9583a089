"""The CPU weights' memory on huge pages: which ranges are collapsed, and that nothing they hold changes."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pdserve.server.decode.huge_pages import HUGE_PAGE, huge_page_ranges, weights_to_huge_pages
from pdserve.server.decode.quant import Linear

MB = 1 << 20


def test_ranges_take_each_mappings_weights_together_cut_to_whole_huge_pages():
    mappings = [(0, 64 * MB), (64 * MB, 65 * MB), (100 * MB, 200 * MB)]
    spans = [
        (3 * MB, 4 * MB), (5 * MB + 10, 9 * MB),  # two small weights of one mapping: [4 MiB, 8 MiB) between them
        (64 * MB, 65 * MB),  # a 1 MiB mapping holds no whole huge page
        (101 * MB, 150 * MB),
        (199 * MB, 201 * MB),  # runs past its mapping's end: left alone
    ]
    assert huge_page_ranges(spans, mappings) == [(4 * MB, 8 * MB), (102 * MB, 150 * MB)]
    assert all(start % HUGE_PAGE == 0 and end % HUGE_PAGE == 0 for start, end in huge_page_ranges(spans, mappings))
    assert huge_page_ranges([(5, 10)], []) == []


def _thp_mode() -> str:
    """always, madvise or never: the bracketed word of the kernel's setting."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1 : text.index("]")]


def test_prepacked_weights_on_huge_pages_compute_the_same_values():
    """Collapsing copies the pages: oneDNN's packed weights must come through bit for bit."""
    g = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.big = Linear.of(torch.randn(2048, 1024, generator=g), torch.randn(2048, generator=g), torch.bfloat16)  # 4 MiB
    model.big.prepack()
    x = torch.randn(3, 1024, generator=g).to(torch.bfloat16)
    before = model.big(x)
    collapsed, note = weights_to_huge_pages(model)
    assert model.big.packed and torch.equal(model.big(x), before)
    if _thp_mode() == "never":
        assert collapsed == 0 and "never" in note
    else:  # 4 MiB of packed weight hold at least one whole huge page
        assert collapsed >= HUGE_PAGE and "huge pages" in note
