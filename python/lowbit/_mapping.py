"""A file's bytes mapped into memory, read as they are used (as llama.cpp
maps a model file)."""
from __future__ import annotations

import mmap
import os
import platform
import sys

import numpy as np

# Linux's MAP_NORESERVE where its value is the generic one (Python's mmap
# module does not name it): the mapping is not charged to the commit limit.
_MAP_NORESERVE = 0x4000 if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") else 0


def map_private(path: str) -> np.ndarray:
    """The file's bytes (uint8) as a private copy-on-write mapping: views are
    writable (torch.from_numpy wants that) and nothing is ever written back
    to the file. np.memmap's mode "c" maps the same way but charges the whole
    file to the commit limit, which refuses a file larger than memory and swap
    (ENOMEM); this mapping is charged nothing, as llama.cpp's read-only one
    is not, its pages read from the file as they are used."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("the file is empty")
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE | _MAP_NORESERVE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(mapping, dtype=np.uint8)
