"""CPU tensors on transparent huge pages, for the weight copies lowbit makes
(joined projections, GPTQ's panels): a matvec streams each weight whole per
token, and on 4 KB pages its TLB misses keep it well below memory speed.
torch's own allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE=1,
which it reads once, as it is imported."""
from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None) if sys.platform == "linux" else None


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device); on the CPU from its own anonymous
    mapping advised MADV_HUGEPAGE before anything touches it, starting on a
    2 MB boundary, so that its first writes fault in whole huge pages. Only a
    hint: where THP is off it is plain memory. Under one huge page, or off
    Linux, torch.empty itself."""
    nbytes = math.prod(shape) * dtype.itemsize
    if _ADVICE is None or nbytes < HUGE_PAGE or torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(_ADVICE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes].view(dtype).view(shape)


def cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat(tensors, dim) into empty()."""
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.cat(tensors, dim, out=empty(tuple(shape), tensors[0].dtype, tensors[0].device))
