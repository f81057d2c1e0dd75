"""GPTQLinear: an nn.Linear replacement whose buffers are exactly a GPTQ
checkpoint's tensors, multiplied by torch.ops.lowbit.gptq_gemm (or, with
int8_activations on the CPU, gptq_gemm_a8)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .._checks import check_flag, check_float_dtype, check_linear, check_sizes, has_values, is_integer
from .._frozen import linear_forward
from .._stored import StoredBuffers, as_buffer, beyond, holds_integers, joinable
from .packing import PANEL_COLS, fields_per_pack, from_panels, to_panels, words_per_pack
from .config import check_bits_group_size, check_format
from .rtn import quantize_rtn

# Layers join only in whole multiples of the CPU kernels' widest column step
# (AVX-512: 64 columns, AVX2: 32). Each column's sum is then computed by the
# same kernel whether it sits in a part or in the joined layer: a narrower
# part's columns would move between a SIMD kernel and its portable tail,
# which sums in another order.
JOIN_COLUMNS = 64
# The scales' (and bias's) dtypes that gptq_gemm and gptq_gemm_a8 read, as a
# checkpoint stores them: a layer made with others (float64) could never run.
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_scale_dtype(who: str, dtype, name: str = "dtype") -> None:
    """ValueError naming `name` for a scales dtype the kernels do not read,
    before a layer is made that fails on its first call."""
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"{who}: {name} must be one of {SCALE_DTYPES}, got {dtype!r}")


def _version(t: torch.Tensor) -> int:
    """t's version counter; -1 for an inference tensor (made under
    torch.inference_mode), which has none: its writes go unseen, as those
    through `.data` do."""
    return -1 if t.is_inference() else t._version


def in_order_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """int32 [in_features]: each input row's group without act-order."""
    if device is not None and torch.device(device).type == "meta":
        # Shape only: meta ops run through Python decompositions (about a
        # millisecond here, for every layer a checkpoint loader builds).
        return torch.empty(in_features, dtype=torch.int32, device="meta")
    g = in_features if group_size == -1 else min(group_size, max(in_features, 1))  # past K: one group
    return (torch.arange(in_features, device=device) // g).to(torch.int32)


def g_idx_out_of_range(g_idx: torch.Tensor, groups: int) -> str | None:
    """Why `g_idx` (integers) names a group outside [0, groups), which the
    kernels refuse on every call; None where it does not (or has no values)."""
    if not g_idx.numel() or not has_values(g_idx):
        return None
    low, high = int(g_idx.min()), int(g_idx.max())
    return None if 0 <= low and high < groups else f"g_idx values must lie in [0, {groups}), found [{low}, {high}]"


class GPTQLinear(StoredBuffers):
    """y = x @ W.T + b for a GPTQ weight W.

    Buffers (state_dict) are the checkpoint's own: `qweight` int32
    [K*bits/32, N], `qzeros` int32 [groups, N*bits/32], `scales` [groups, N],
    `g_idx` int32 [K] and optional `bias` [N], so `load_state_dict` reads a
    checkpoint and `state_dict()` writes one. The kernels read act-order
    weights with their rows sorted by group (contiguous groups whatever the
    checkpoint's order), in one of two ways. By default the layer keeps a
    private sorted copy of `qweight`, made the first time it runs and checked
    against its buffers on every call, so that any write into them (through
    `.data` too) takes effect. After sort_rows() (as the checkpoint loaders
    call it) `qweight` itself holds the sorted rows: no second copy and no
    check per call; `state_dict()` still writes the checkpoint's order, and
    new weights come in through `load_state_dict`.

    `int8_activations` (False by default) multiplies CPU inputs with
    gptq_gemm_a8: each row's groups rounded to int8, as llama.cpp rounds its
    activations, for integer dot products that leave a matvec bound by memory
    (the fp32 kernel is bound by its instructions) and prefill several times
    faster. It needs groups of equal size, as every GPTQ checkpoint has them,
    and applies to 2-, 4- and 8-bit layers: 3-bit fields straddle words,
    which only gptq_gemm_a8's portable loop reads, and gptq_gemm's SIMD fp32
    kernel is faster there.

    `repack()` (a layer on the CPU, out_features a multiple of 64; what
    lowbit.repack_model does to every one) holds qweight in the panel layout
    (packing.to_panels), its rows sorted by group first: each 64 columns'
    rows one contiguous stream, which gptq_gemm_a8 reads about a third
    faster from memory, and gptq_gemm's fp32 kernel faster in layers a few
    thousand columns wide (benchmarks/results), with the same results bit
    for bit. state_dict(), dequantize() and
    a move to another device still see the checkpoint's layout.
    """

    # The checkpoint's scales and bias keep their dtype through model.to(dtype):
    # fp16 scales rounded to bf16 would change every weight.
    STORED_FLOATS = ("scales", "bias")
    # Class defaults, so that layers pickled without the attributes have them.
    _int8_activations = False
    repacked = False

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, sym: bool = True,
                 desc_act: bool = False, checkpoint_format: str = "gptq", bias: bool = True,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        check_bits_group_size("GPTQLinear", bits, group_size)
        check_format(checkpoint_format, "GPTQLinear")
        check_sizes("GPTQLinear", in_features=in_features, out_features=out_features)
        sym, desc_act = check_flag("GPTQLinear", "sym", sym), check_flag("GPTQLinear", "desc_act", desc_act)
        bias = check_flag("GPTQLinear", "bias", bias)
        check_scale_dtype("GPTQLinear", dtype)  # the scales' and bias's dtype
        if in_features % fields_per_pack(bits) or out_features % fields_per_pack(bits):
            raise ValueError(f"GPTQLinear: {bits}-bit packing needs in_features and out_features to be multiples "
                             f"of {fields_per_pack(bits)}, got {in_features} and {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym, self.desc_act = bits, group_size, sym, desc_act
        self.checkpoint_format = checkpoint_format
        groups = 1 if group_size == -1 else -(-in_features // group_size)  # integers: any size, however large
        words = words_per_pack(bits)
        self.register_buffer("qweight", torch.zeros(in_features // fields_per_pack(bits) * words, out_features,
                                                    dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // fields_per_pack(bits) * words,
                                                   dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("g_idx", in_order_g_idx(in_features, group_size, device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        # After sort_rows(): qweight's row k is the checkpoint's row row_order[k], of group
        # sorted_g_idx[k]. Not state: state_dict writes the checkpoint's order.
        self.register_buffer("row_order", None, persistent=False)
        self.register_buffer("sorted_g_idx", None, persistent=False)
        self._sorted_key = None
        # How to run (_new_plan), one attribute so that threads sharing the layer never see one
        # plan's key with another plan's tensors.
        self._plan = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, sym: bool = True,
                    checkpoint_format: str = "gptq", perm: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float16) -> GPTQLinear:
        """Round-to-nearest GPTQ quantization of `linear` (act-order when `perm`
        gives the order in which GPTQ would process the input rows)."""
        check_linear("GPTQLinear.from_linear", linear)
        sym = check_flag("GPTQLinear.from_linear", "sym", sym)
        check_scale_dtype("GPTQLinear.from_linear", dtype)  # before the work: quantize_rtn also writes float64
        t = quantize_rtn(linear.weight, bits, group_size, sym, checkpoint_format, perm, scale_dtype=dtype)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_tensors(t.qweight, t.qzeros, t.scales, t.g_idx, bias, bits, group_size, sym, perm is not None,
                                checkpoint_format)

    @classmethod
    def from_tensors(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: torch.Tensor | None, bias: torch.Tensor | None, bits: int, group_size: int,
                     sym: bool = True, desc_act: bool = False, checkpoint_format: str = "gptq") -> GPTQLinear:
        """A layer whose buffers are these tensors themselves, not copies (a
        memory-mapped checkpoint's stay mapped, read as they are used):
        g_idx as int32 (in order where None), bias in the scales' dtype, a
        tensor that is not contiguous (columns of another layer's) a
        contiguous copy."""
        check_bits_group_size("GPTQLinear.from_tensors", bits, group_size)  # before the packing sizes divide by bits
        sym = check_flag("GPTQLinear.from_tensors", "sym", sym)
        desc_act = check_flag("GPTQLinear.from_tensors", "desc_act", desc_act)
        args = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx, "bias": bias}
        for name, tensor in args.items():  # a list's or None's AttributeError would name no argument
            if not (isinstance(tensor, torch.Tensor) or (tensor is None and name in ("g_idx", "bias"))):
                raise TypeError(f"GPTQLinear.from_tensors: {name} must be a tensor, got {type(tensor).__name__}")
        check_scale_dtype("GPTQLinear.from_tensors", scales.dtype, "scales")
        if bias is not None and not bias.is_floating_point():  # a cast would drop a complex bias's imaginary part
            raise ValueError(f"GPTQLinear.from_tensors: bias must be a float tensor, got {bias.dtype}")
        if qweight.dim() != 2:  # its shape gives the layer's: shape[1] of a 1-D one is a bare IndexError
            raise ValueError(f"GPTQLinear.from_tensors: qweight must be 2-D [packed rows, out_features], got "
                             f"{tuple(qweight.shape)}")
        in_features = qweight.shape[0] // words_per_pack(bits) * fields_per_pack(bits)
        layer = cls(in_features, qweight.shape[1], bits, group_size, sym, desc_act, checkpoint_format,
                    bias is not None, scales.dtype, device="meta")
        if g_idx is not None:
            if not holds_integers(g_idx):
                raise ValueError(f"GPTQLinear.from_tensors: g_idx must hold integers, got {g_idx.dtype}")
            if (v := beyond(g_idx, torch.int32)) is not None:
                raise ValueError(f"GPTQLinear.from_tensors: g_idx holds {v}, beyond int32")
            if error := g_idx_out_of_range(g_idx, layer.qzeros.shape[0]):
                raise ValueError(f"GPTQLinear.from_tensors: {error}")
        g_idx = in_order_g_idx(in_features, group_size, qweight.device) if g_idx is None else g_idx.to(torch.int32)
        given = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
        if bias is not None:
            given["bias"] = bias.to(scales.dtype)
        for name, tensor in given.items():
            expect = getattr(layer, name)
            if tensor.dtype != expect.dtype or tensor.shape != expect.shape:
                raise ValueError(f"GPTQLinear.from_tensors: {name} must be {expect.dtype} {tuple(expect.shape)} "
                                 f"beside qweight {tuple(qweight.shape)} at {bits} bits, got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")
            setattr(layer, name, as_buffer(tensor))
        return layer

    @property
    def int8_activations(self) -> bool:
        return self._int8_activations

    @int8_activations.setter
    def int8_activations(self, value) -> None:
        # Set after construction (load_gptq_model, a user): read by truthiness, a string such as
        # "False" or "off" would turn the mode on.
        self._int8_activations = check_flag("GPTQLinear", "int8_activations", value)

    def layout(self) -> dict:
        # The zeros' format: v1 zeros are stored one below v2's, in tensors of the same shapes.
        return {"checkpoint_format": self.checkpoint_format}

    def can_join(self, other: nn.Module) -> bool:
        """Whether `other`'s output columns can follow this layer's in one
        layer (joined) with the same results: the same quantization of the
        same inputs, act-order included (q, k and v quantized on one Hessian
        share their g_idx), both as wide as whole JOIN_COLUMNS."""
        same = ("in_features", "bits", "group_size", "sym", "desc_act", "checkpoint_format", "int8_activations")
        return (type(other) is type(self) and self.out_features % JOIN_COLUMNS == 0
                and other.out_features % JOIN_COLUMNS == 0 and all(getattr(other, a) == getattr(self, a) for a in same)
                and other.rows_sorted == self.rows_sorted and not (self.repacked or other.repacked)
                and other.scales.dtype == self.scales.dtype and other.qweight.device == self.qweight.device
                and (self.bias is None) == (other.bias is None) and not (self.g_idx.is_meta or other.g_idx.is_meta)
                and torch.equal(other.g_idx, self.g_idx))  # a meta g_idx has no values to compare: no join

    @classmethod
    def joined(cls, layers: Iterable[GPTQLinear], back_to_back=None) -> GPTQLinear:
        """One layer whose output columns are those of `layers` (which
        can_join), in order; a new copy of their tensors (back_to_back, a
        GGUF file's join, has nothing to offer GPTQ's column-major packing)."""
        layers = joinable(cls, layers, "the same quantization, g_idx, row order, device and bias, none repacked")
        first = layers[0]
        joined = {name: torch.cat([getattr(layer, name) for layer in layers], dim=-1)
                  for name in ("qweight", "qzeros", "scales")}
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
        layer = cls.from_tensors(joined["qweight"], joined["qzeros"], joined["scales"], first.g_idx, bias,
                                 first.bits, first.group_size, first.sym, first.desc_act, first.checkpoint_format)
        if first.rows_sorted:  # equal g_idx: every part's rows are in the same order
            layer._mark_sorted(first.row_order, first.sorted_g_idx)
        layer.int8_activations = first.int8_activations
        return layer

    def part_state(self, cols: slice) -> dict[str, torch.Tensor]:
        """The state of a layer of output columns `cols` of this one (each
        end a multiple of a zero pack's fields, as every layer's width is)."""
        fields, words = fields_per_pack(self.bits), words_per_pack(self.bits)
        # qzeros are cut by whole packs from start to stop: a step, an open or
        # negative end or one inside a pack would give zeros of other columns.
        if not (isinstance(cols, slice) and cols.step in (None, 1) and is_integer(cols.start)
                and is_integer(cols.stop) and 0 <= cols.start < cols.stop <= self.out_features
                and cols.start % fields == 0 and cols.stop % fields == 0):
            raise ValueError(f"GPTQLinear.part_state: cols must be a slice(start, stop) with 0 <= start < stop <= "
                             f"{self.out_features}, both multiples of {fields}, got {cols!r}")
        zeros = slice(cols.start // fields * words, cols.stop // fields * words)
        # One tensor each: savers drop a tensor they have seen (tied weights).
        state = {"qweight": self.checkpoint_qweight(cols), "qzeros": self.qzeros[:, zeros],
                 "scales": self.scales[:, cols], "g_idx": self.g_idx.clone()}
        if self.bias is not None:
            state["bias"] = self.bias[cols]
        return state

    @property
    def rows_sorted(self) -> bool:
        """Whether qweight holds its rows sorted by group (sort_rows)."""
        return self.row_order is not None

    @torch.inference_mode(False)  # rows made in inference mode must serve later calls that save for backward
    def sort_rows(self) -> GPTQLinear:
        """An act-order layer's qweight rows sorted by group, in place (the
        layout the kernels read): the layer then holds one copy of its
        weights and checks nothing per call. state_dict() and dequantize()
        still give the checkpoint's order; load_state_dict sorts what it
        loads. A write into qweight or g_idx other than through
        load_state_dict is an error the next call reports (one through
        `.data` goes unseen: use unsort_rows() first). A layer whose g_idx is
        already in group order stays as it is. Returns self."""
        # A meta layer's g_idx has no values to sort by: it stays as it is.
        if not self.rows_sorted and not self.g_idx.is_meta and (form := self._sorted_form()) is not None:
            rows, sorted_g_idx, order = form
            self.qweight = rows
            self._mark_sorted(order, sorted_g_idx)
        return self

    @torch.inference_mode(False)
    def unsort_rows(self) -> GPTQLinear:
        """qweight back in the checkpoint's row order (and layout), in place;
        returns self."""
        self.unrepack()
        if self.rows_sorted:
            self.qweight = self.checkpoint_qweight()
            self.row_order = self.sorted_g_idx = self._sorted_key = None
        return self

    def can_repack(self) -> bool:
        """Whether repack() applies: a layer on the CPU whose out_features is
        a multiple of the panel width."""
        return self.out_features % PANEL_COLS == 0 and self.qweight.device.type == "cpu"

    @torch.inference_mode(False)
    def repack(self) -> GPTQLinear:
        """qweight's rows sorted by group (sort_rows) and held in the panel
        layout, in place (see the class docstring); returns self."""
        if not self.repacked:
            if not self.can_repack():
                why = (f"qweight is on {self.qweight.device}" if self.qweight.device.type != "cpu" else
                       f"out_features={self.out_features} is not a multiple of its {PANEL_COLS} columns")
                raise ValueError(f"GPTQLinear.repack: the panel layout is the CPU kernels'; {why}")
            self.sort_rows()
            self._hold(to_panels(self.qweight), repacked=True)
        return self

    @torch.inference_mode(False)
    def unrepack(self) -> GPTQLinear:
        """qweight back in the checkpoint's layout (its rows still sorted where
        they were), in place; returns self."""
        if self.repacked:
            self._hold(from_panels(self.qweight), repacked=False)
        return self

    def _hold(self, qweight: torch.Tensor, repacked: bool) -> None:
        """qweight in the layout `repacked` says; the check per call of sorted
        rows and the plan follow the new buffer."""
        self.qweight, self.repacked = qweight, repacked
        if self.rows_sorted:
            self._sorted_key = self._key()
        self._plan = None

    def checkpoint_qweight(self, cols: slice = slice(None)) -> torch.Tensor:
        """qweight's columns `cols` in the checkpoint's row order and layout (a
        copy where the rows are sorted or repacked)."""
        rows = from_panels(self.qweight) if self.repacked else self.qweight
        if not self.rows_sorted:
            return rows[:, cols]
        return self._permuted_rows(rows, cols, torch.argsort(self.row_order))

    def _sorted_form(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(qweight's rows sorted by group, the sorted g_idx, the order), or
        None where g_idx is in order already."""
        order = torch.argsort(self.g_idx, stable=True)
        if torch.equal(order, torch.arange(order.numel(), device=order.device)):
            return None
        if self.repacked:
            raise RuntimeError("GPTQLinear: g_idx of a repacked layer was changed in place to an order whose rows "
                               "need sorting; call unrepack() before writing weights other than by load_state_dict")
        return self._permuted_rows(self.qweight, slice(None), order), self.g_idx[order].to(torch.int32), order

    def _permuted_rows(self, rows: torch.Tensor, cols: slice, order: torch.Tensor) -> torch.Tensor:
        return torch.ops.lowbit.gptq_permute_rows(rows[:, cols].contiguous(), order.to(torch.int32), self.bits)

    def _mark_sorted(self, order: torch.Tensor, sorted_g_idx: torch.Tensor) -> None:
        self.row_order, self.sorted_g_idx = order, sorted_g_idx
        self._plan, self._sorted_key = None, self._key()

    @property
    def use_v2_format(self) -> bool:
        """Whether qzeros hold the zeros themselves (gptq_v2) rather than zero - 1 (gptq)."""
        return self.checkpoint_format == "gptq_v2"

    def _prepare(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(qweight, g_idx, perm) for gptq_gemm on x2: x[..., perm] @ W[perm] = x @ W.

        A layer whose g_idx is in order runs on its own buffers with no check
        per call (any later g_idx is still honoured: the op takes any), as
        does a layer whose rows sort_rows() sorted (a comparison of version
        counters only). Otherwise an act-order layer runs on a private copy
        of qweight with its rows sorted by group (perm) and the sorted g_idx,
        which the kernels read as contiguous groups; the activations are
        permuted to match. That copy's source is checked on every call: writes
        through `.data` (how many loaders copy weights in) bump no version
        counter, so besides g_idx's values the check reads qweight's first
        packed row and first column, which every write of whole rows or whole
        columns meets (a checkpoint, or a row or column shard of one). The row is contiguous: that is
        N / 16 + rows cache lines, where a diagonal through every row and
        column would be max(N, rows) scattered ones, a read from memory that
        costs more than a small layer's matmul. While torch.compile traces,
        which could not redo that check per call, an act-order layer whose
        rows are not sorted runs on its own buffers: gptq_gemm takes any
        g_idx (slower, and with fp32 activations where the layer has
        int8_activations: sort_rows() first, as the checkpoint loaders do).
        """
        if self._buffers["g_idx"].is_meta:  # no values to plan from: the op's shapes are all a meta call has
            return self.qweight, self.g_idx, None
        if self._buffers["row_order"] is not None:
            if not torch.compiler.is_compiling() and self._sorted_key != self._key():
                raise RuntimeError("GPTQLinear: qweight or g_idx was changed in place after sort_rows(); load new "
                                   "weights with load_state_dict (or call unsort_rows() before writing them)")
            return self._buffers["qweight"], self._buffers["sorted_g_idx"], self._buffers["row_order"]
        if not has_values(x2):  # traced, fake or vmapped inputs: no values to plan from
            return self.qweight, self.g_idx, None
        plan = self._plan
        if plan is None or not self._still_valid(plan):
            plan = self._plan = self._new_plan()
        return plan[1] if plan[1] is not None else (self.qweight, self.g_idx, None)

    def private_copy(self) -> tuple | None:
        """The plan whose private sorted copy of the rows this layer runs on
        (act-order, rows unsorted), or None where it runs on its own buffers;
        copy_current(plan) says whether it still holds the rows it copied."""
        plan = self._plan
        return plan if plan is not None and plan[1] is not None and self._buffers["row_order"] is None else None

    def copy_current(self, plan: tuple) -> bool:
        """Whether `plan` (from private_copy()) is still the layer's plan and its
        copy still matches qweight and g_idx."""
        return self._plan is plan and self._still_valid(plan)

    def _key(self) -> tuple:
        # Read from _buffers directly: nn.Module's attribute lookup is a cost per call here.
        q, g = self._buffers["qweight"], self._buffers["g_idx"]
        return q.data_ptr(), _version(q), g.data_ptr(), _version(g)

    def _still_valid(self, plan: tuple) -> bool:
        key, sorted_, g_idx, where, sample = plan
        if sorted_ is None:  # in order: only a new g_idx could call for sorting
            g = self._buffers["g_idx"]
            return (g.data_ptr(), _version(g)) == key[2:]
        return (self._key() == key and torch.equal(self._buffers["g_idx"], g_idx)
                and torch.equal(torch.take(self._buffers["qweight"], where), sample))

    @torch.inference_mode(False)  # a plan made in inference mode must serve a later call that saves for backward
    def _new_plan(self) -> tuple:
        """(key, (sorted qweight, sorted g_idx, perm) or None when g_idx is in
        order, g_idx copy, sampled qweight positions, their words)."""
        key, form = self._key(), self._sorted_form()
        if form is None:
            return key, None, None, None, None
        q_rows, cols = self.qweight.shape
        device = self.g_idx.device
        where = torch.cat([torch.arange(cols, device=device),
                           torch.arange(1, q_rows, device=device) * cols])  # row 0, column 0
        return key, form, self.g_idx.clone(), where, torch.take(self.qweight, where)

    def op_call(self, x2: torch.Tensor) -> tuple:
        """(op, args): op(*args) multiplies the rows x2 [rows, in_features] by
        this layer's weight, without the bias (forward's call, and
        lowbit.decoding's, which skips the module)."""
        op, args, perm = self.op_template(x2)
        return op, args if perm is None else (x2.index_select(1, perm), *args[1:])

    def op_template(self, x2: torch.Tensor) -> tuple:
        """(op, args, perm): op_call's call with x2 itself as args[0], and the
        column order the op reads it in (perm: x2[:, perm] takes its place;
        None where x2 goes in as it is). lowbit.decoding's C++ step keeps the
        template and puts each token's row in x2's place."""
        qweight, g_idx, perm = self._prepare(x2)
        buffers = self._buffers
        v2 = self.checkpoint_format == "gptq_v2"
        cpu = x2.device.type == "cpu"
        if self.repacked and not cpu:
            raise RuntimeError(f"GPTQLinear: a repacked layer runs on the CPU kernels; got {x2.device} inputs: call "
                               f"unrepack() first")
        # gptq_gemm_a8 needs contiguous groups, which a traced (fake, vmapped)
        # act-order layer with unsorted rows (_prepare) does not give it: gptq_gemm takes any.
        unsorted = self.desc_act and perm is None and not self.rows_sorted and not has_values(x2)
        if self.int8_activations and self.bits != 3 and cpu and not unsorted:
            return torch.ops.lowbit.gptq_gemm_a8, (x2, qweight, buffers["qzeros"], buffers["scales"], g_idx, v2,
                                                   self.bits), perm
        return torch.ops.lowbit.gptq_gemm, (x2, qweight, buffers["qzeros"], buffers["scales"], g_idx, False, v2,
                                            self.bits), perm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out_features, in_features] in `dtype` (default: the
        scales' dtype), computed exactly in fp32 and rounded once."""
        if dtype is not None:
            check_float_dtype("GPTQLinear.dequantize", dtype)
        w = torch.ops.lowbit.gptq_dequantize(self.checkpoint_qweight(), self.qzeros, self.scales.float(), self.g_idx,
                                             self.use_v2_format, self.bits)
        return w.t().to(dtype or self.scales.dtype)

    def _apply(self, fn, recurse=True):
        # Only the CPU kernels read the panel layout: going anywhere else,
        # qweight goes back to the checkpoint's layout first.
        if self.repacked and fn(torch.empty(0, dtype=torch.int32)).device.type != "cpu":
            self.unrepack()
        out = super()._apply(fn, recurse)
        if self.rows_sorted:  # moved: the check's key follows the buffers
            self._sorted_key = self._key()
        plan = self._plan
        if plan is not None and plan[0] != self._key():  # a plan of the buffers left behind, its copy with them
            self._plan = None
        return out

    def __getstate__(self):
        # The plan holds a private sorted copy of qweight, keyed to these
        # buffers' addresses: a copy (deepcopy, pickle, torch.save) would hold
        # the weights twice, and plans its own from its buffers anyway.
        return {**super().__getstate__(), "_plan": None}

    def __setstate__(self, state):
        if "int8_activations" in state:  # pickled as a plain attribute, which the property would hide
            state = {**state, "_int8_activations": bool(state["int8_activations"])}
            del state["int8_activations"]
        super().__setstate__(state)
        if self.rows_sorted:  # a copy (deepcopy, pickle) holds new buffers of the same rows
            self._sorted_key = self._key()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.rows_sorted or self.repacked:  # a state dict holds the checkpoint's order, whatever loads it
            destination[prefix + "qweight"] = self.checkpoint_qweight()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        g_idx = state_dict.get(prefix + "g_idx")
        # One that is not integers, or beyond int32, _dtypes_match names as such.
        if holds_integers(g_idx) and beyond(g_idx, torch.int32) is None \
                and (error := g_idx_out_of_range(g_idx, self.qzeros.shape[0])):
            error_msgs.append(f"GPTQLinear: {prefix}{error}")  # the layer is left as it was
            return
        sorted_, repacked = self.rows_sorted, self.repacked
        self.unsort_rows()  # what is not loaded stays the checkpoint's
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if sorted_:
            self.sort_rows()
        if repacked:
            self.repack()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, sym={self.sym}, desc_act={self.desc_act}, "
                f"checkpoint_format={self.checkpoint_format!r}, bias={self.bias is not None}"
                + (", rows_sorted=True" if self.rows_sorted else "") + (", repacked=True" if self.repacked else "")
                + (", int8_activations=True" if self.int8_activations else ""))
