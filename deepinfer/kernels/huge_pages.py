"""Host memory in transparent huge pages, for the big buffers a decode step streams through.

A step reads every packed weight and every live KV row once. Held in 4 KiB pages, those reads take a
TLB miss every 4 KiB and the hardware prefetchers stop at each page boundary; in 2 MiB pages they do
not. Linux gives anonymous memory huge pages only where asked (`madvise(MADV_HUGEPAGE)` when THP is
in "madvise" mode, the common default); this module asks. Where the kernel declines (THP "never",
no MADV_HUGEPAGE), the memory is ordinary and only the speed differs.
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["HUGE_PAGE", "huge_page_bytes", "huge_page_zeros"]

HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of `nbytes` starting on a 2 MiB boundary, in an anonymous mapping
    advised to use huge pages. The mapping lives as long as any tensor viewing it (torch.frombuffer
    keeps the mmap object alive)."""
    region = mmap.mmap(-1, max(nbytes, 1) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    start = -flat.data_ptr() % HUGE_PAGE
    return flat[start:start + nbytes]


def huge_page_zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype, prefault: bool = False) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in huge pages (see huge_page_bytes). With `prefault`, every
    page is written once now, so no later access takes a page fault.

    Why prefault: the first write to a page of a region advised MADV_HUGEPAGE makes the kernel find a free 2 MiB
    page, and under THP's default defrag setting ("madvise") it compacts memory synchronously to make one.
    On a VM whose memory is fragmented that measured 6-12 ms per MiB (the next 100 MiB, once compacted, 12 ms
    in all): a 1,024-token prefill into KV blocks never used before spent 0.26-0.34 s of its 1.2-1.4 s in
    those faults, and any request reaching fresh blocks stalled the whole step. Prefaulted, that cost is
    paid once at startup."""
    n = 1
    for d in shape:
        n *= int(d)
    itemsize = torch.empty((), dtype=dtype).element_size()
    flat = huge_page_bytes(n * itemsize)
    if prefault and flat.numel():
        flat[::4096].zero_()  # a write per 4 KiB: every page faults in, huge or not
    return flat.view(dtype).view(tuple(shape))
