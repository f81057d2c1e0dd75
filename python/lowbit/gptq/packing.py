"""Shape arithmetic of GPTQ packing (the packing itself is C++): b-bit fields
fill int32 words in packs of 32 fields in 3 words (3-bit) or 32/b fields in
one word (2/4/8-bit); and the panel layout of qweight."""
import torch

# Columns per panel of the panel layout [N / PANEL_COLS, K*bits/32, PANEL_COLS]
# that gptq_gemm_a8 reads beside the checkpoint's (kGptqPanelCols in
# csrc/ops/gptq_checks.h).
PANEL_COLS = 64


def fields_per_pack(bits: int) -> int:
    return 32 if bits == 3 else 32 // bits


def words_per_pack(bits: int) -> int:
    return 3 if bits == 3 else 1


def to_panels(qweight: torch.Tensor) -> torch.Tensor:
    """qweight [rows, N] (N a multiple of PANEL_COLS) in the panel layout
    [N / PANEL_COLS, rows, PANEL_COLS]: each run of PANEL_COLS columns holds
    its rows back to back, so that a kernel reading those columns reads one
    contiguous stream, where the checkpoint's rows are N words apart."""
    if qweight.dim() != 2 or qweight.shape[1] % PANEL_COLS:
        raise ValueError(f"to_panels: qweight must be 2-D [rows, N] with N a multiple of {PANEL_COLS}, got shape "
                         f"{tuple(qweight.shape)}")
    rows, n = qweight.shape
    return qweight.view(rows, n // PANEL_COLS, PANEL_COLS).transpose(0, 1).contiguous()


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    """The checkpoint's qweight [rows, N] of a panel-layout one (to_panels)."""
    if panels.dim() != 3 or panels.shape[2] != PANEL_COLS:  # a 2-D qweight would come back transposed
        raise ValueError(f"from_panels: panels must be 3-D [N / {PANEL_COLS}, rows, {PANEL_COLS}], got shape "
                         f"{tuple(panels.shape)}")
    return panels.transpose(0, 1).reshape(panels.shape[1], -1)
