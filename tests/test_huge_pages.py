"""The weight copies lowbit makes (joined projections, GPTQ's panels and
sorted rows, quantized float tables) lie on memory advised for transparent
huge pages ("hg"): a matvec streams each weight whole per token, and on 4 KB
pages a 1B model's joined projections decoded about a fifth slower. The copies
hold the same values as torch's own."""
import gc
import os

import numpy as np
import pytest
import torch
from torch import nn

import gguf_blocks as gb
from memory_maps import HUGE_PAGE, first_huge_page, vm_flags_at
import lowbit
from lowbit import _huge_pages as huge_pages
from lowbit.gptq.packing import from_panels, to_panels

pytestmark = pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                                reason="transparent huge pages are a Linux kernel's")


def test_empty_starts_on_a_huge_page_and_frees_its_mapping():
    t = huge_pages.empty((3, HUGE_PAGE // 4), torch.int32)
    assert t.shape == (3, HUGE_PAGE // 4) and t.dtype == torch.int32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and "hg" in vm_flags_at(t.data_ptr())
    t.fill_(7)
    assert int(t.sum()) == 7 * t.numel()
    address = t.data_ptr()
    view = t[1:]
    del t
    gc.collect()
    assert "hg" in vm_flags_at(address)  # a view keeps the mapping
    del view
    gc.collect()
    with pytest.raises(AssertionError, match="no mapping holds"):
        vm_flags_at(address)


def test_empty_below_a_huge_page_and_off_the_cpu_is_torch_empty():
    small = huge_pages.empty((HUGE_PAGE // 8 - 1,), torch.float32)
    assert small.shape == (HUGE_PAGE // 8 - 1,) and small.dtype == torch.float32
    meta = huge_pages.empty((HUGE_PAGE,), torch.uint8, "meta")
    assert meta.is_meta and meta.shape == (HUGE_PAGE,)


@pytest.mark.parametrize("dim", [0, -1])
def test_cat_equals_torch_cat(dim):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randint(-2**31, 2**31 - 1, (512, 1024 + 64 * i), generator=g, dtype=torch.int32) if dim else
             torch.randint(-2**31, 2**31 - 1, (512 + 8 * i, 1024), generator=g, dtype=torch.int32) for i in range(3)]
    out = huge_pages.cat(parts, dim)
    assert torch.equal(out, torch.cat(parts, dim))
    assert "hg" in vm_flags_at(first_huge_page(out))


def test_joined_gguf_rows_lie_on_huge_pages():
    rng = np.random.default_rng(0)
    n, qtype = 4096, gb.type_id("Q8_0")
    layers = [lowbit.GGUFLinear.from_raw(torch.from_numpy(gb.random_blocks(rng, "Q8_0", rows, n)), qtype, n)
              for rows in (4096, 1024, 1024)]
    joined = lowbit.GGUFLinear.joined(layers)
    assert "hg" in vm_flags_at(first_huge_page(joined.qweight))
    x = torch.randn(3, n)
    with torch.no_grad():
        assert torch.equal(joined(x), torch.cat([layer(x) for layer in layers], -1))


def test_gptq_copies_lie_on_huge_pages():
    """Joined columns, the panel layout, act-order's sorted rows: each a
    weight the kernels stream."""
    torch.manual_seed(0)
    k = 4096
    layers = [lowbit.GPTQLinear.from_linear(nn.Linear(k, n, bias=False), 4, 128, perm=torch.randperm(k))
              for n in (2048, 1024)]
    layers[1].g_idx.copy_(layers[0].g_idx)  # one Hessian's order, as q, k and v share
    joined = lowbit.GPTQLinear.joined(layers)
    assert "hg" in vm_flags_at(first_huge_page(joined.qweight))
    panels = to_panels(joined.qweight)
    assert "hg" in vm_flags_at(first_huge_page(panels)) and torch.equal(from_panels(panels), joined.qweight)
    order = torch.argsort(joined.g_idx, stable=True).to(torch.int32)
    sorted_rows = torch.ops.lowbit.gptq_permute_rows(joined.qweight, order, 4)
    assert "hg" in vm_flags_at(first_huge_page(sorted_rows))


def test_quantized_float_tables_lie_on_huge_pages():
    table = torch.randn(8192, 1024, dtype=torch.float16)
    for qtype in ("Q8_0", "Q6_K"):
        blocks = torch.ops.lowbit.ggml_quantize(table, gb.type_id(qtype))
        assert "hg" in vm_flags_at(first_huge_page(blocks))
