"""llama.cpp (llama-cpp-python, the optional extra `make reference-deps`
builds) as lowbit's independent reference and benchmark peer, at two levels:

- op level: one ggml_mul_mat (GgmlMatmul) or ggml_mul_mat_id (GgmlMulMatId)
  of a given quant type by llama.cpp's CPU backend, on the same blocks as
  lowbit (tests/test_cpu_kernels.py, test_gguf_mul_mat_id.py,
  benchmarks/bench_gguf.py, bench_gguf_moe.py);
- model level: llama.cpp's Llama on a whole GGUF file, callable like a
  transformers model (llama_without_extra_buffers, LlamaCppLogits;
  tests/test_llama_cpp_model.py, test_llama_cpp_architectures.py).

Tests import it as `llama_cpp_peer` (pytest puts tests/ on the path), the
benchmarks as `tests.llama_cpp_peer` (run from the repository root).

ggml is reached through the shared libraries that PyPI's llama-cpp-python
builds and ships (llama_cpp/lib/libggml-base.so, libggml-cpu.so), with a few
ctypes declarations of ggml's public C API (ggml.h, ggml-cpu.h): a context
that owns the tensors, W as an [n, rows] tensor of the quant type holding
lowbit's bytes, x as [n, M] fp32, and ggml_graph_compute_with_ctx with
n_threads, planned once per thread count (ggml_graph_plan) with a work buffer
we own: ggml_graph_compute_with_ctx would take a new work buffer from the
context on every call. ggml quantizes x to the type's 8-bit activation blocks
inside the call, as lowbit does. An optional extra: `pip install llama-cpp-python`.
LOWBIT_GGML_LIB_DIR names another directory holding the two libraries, e.g.
the same ggml built for AVX2 only, to meet lowbit's AVX2 kernels on an
AVX-512 machine (benchmarks/README.md).

llama.cpp's own model loader does not leave every weight in that plain layout:
where the CPU backend has an "extra" buffer type for a weight's type (CPU_REPACK:
rows interleaved for its x86/ARM GEMM kernels; AMX: Intel AMX tiles), the weight
is repacked into it when the model loads. `GgmlMatmul(..., buffer=name)` places W
in such a buffer the same way (ggml_backend_tensor_set does the repacking), and
`extra_buffers()` lists the ones this build and CPU have, and `buffer_takes()`
asks whether one takes a given matmul. A buffer type can crash the process on
some machines (the AMX one segfaults for M > 1 on some Xeons), so
`runs_in_subprocess` tries a configuration in a child first.
"""
import ctypes
import os
import subprocess
import sys

import numpy as np


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):  # struct ggml_cplan of the ggml that llama-cpp-python 0.3.36 vendors
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


_ToFloat = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_FromFloat = _ToFloat  # (const float *, void *, int64_t k): the same C signature


class _TypeTraits(ctypes.Structure):  # struct ggml_type_traits (ggml.h)
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", _ToFloat),
                ("from_float_ref", ctypes.c_void_p)]


def _load():
    import llama_cpp  # noqa: F401  (the package that ships the libraries)

    lib_dir = os.environ.get("LOWBIT_GGML_LIB_DIR") or os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    base.ggml_init.argtypes, base.ggml_init.restype = [_InitParams], p
    base.ggml_free.argtypes, base.ggml_free.restype = [p], None
    base.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_new_tensor_2d.restype = p
    base.ggml_new_tensor_3d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    base.ggml_new_tensor_3d.restype = p
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [p], p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [p], ctypes.c_size_t
    base.ggml_mul_mat.argtypes, base.ggml_mul_mat.restype = [p, p, p], p
    base.ggml_mul_mat_id.argtypes, base.ggml_mul_mat_id.restype = [p, p, p, p], p
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [p], p
    base.ggml_build_forward_expand.argtypes, base.ggml_build_forward_expand.restype = [p, p], None
    cpu.ggml_graph_plan.argtypes, cpu.ggml_graph_plan.restype = [p, ctypes.c_int, p], _CPlan
    cpu.ggml_graph_compute.argtypes = [p, ctypes.POINTER(_CPlan)]
    cpu.ggml_graph_compute.restype = ctypes.c_int
    base.ggml_get_type_traits.argtypes, base.ggml_get_type_traits.restype = [ctypes.c_int], ctypes.POINTER(_TypeTraits)
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    cpu.ggml_cpu_init()
    # ggml-backend: the CPU device's extra buffer types and allocation in them.
    cpu.ggml_backend_cpu_reg.argtypes, cpu.ggml_backend_cpu_reg.restype = [], p
    base.ggml_backend_reg_dev_get.argtypes, base.ggml_backend_reg_dev_get.restype = [p, ctypes.c_size_t], p
    base.ggml_backend_reg_get_proc_address.argtypes = [p, ctypes.c_char_p]
    base.ggml_backend_reg_get_proc_address.restype = p
    base.ggml_backend_buft_name.argtypes, base.ggml_backend_buft_name.restype = [p], ctypes.c_char_p
    base.ggml_backend_alloc_ctx_tensors_from_buft.argtypes = [p, p]
    base.ggml_backend_alloc_ctx_tensors_from_buft.restype = p
    base.ggml_backend_tensor_set.argtypes = [p, p, ctypes.c_size_t, ctypes.c_size_t]
    base.ggml_backend_tensor_set.restype = None
    base.ggml_backend_dev_supports_op.argtypes, base.ggml_backend_dev_supports_op.restype = [p, p], ctypes.c_bool
    base.ggml_backend_buffer_free.argtypes, base.ggml_backend_buffer_free.restype = [p], None
    return base, cpu


_LIBS = None


def available():
    """None when the peer can run, else the reason it cannot."""
    global _LIBS
    if _LIBS is None:
        try:
            _LIBS = _load()
        except (ImportError, OSError, AttributeError) as e:
            return f"llama.cpp peer unavailable ({type(e).__name__}: {e}); pip install llama-cpp-python"
    return None


def _cpu_device_and_extra_buffers():
    base, cpu = _LIBS
    reg = cpu.ggml_backend_cpu_reg()
    get = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    device = base.ggml_backend_reg_dev_get(reg, 0)
    bufts = {}
    if get:
        listed = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(get)(device)
        i = 0
        while listed and listed[i]:  # NULL-terminated
            bufts[base.ggml_backend_buft_name(listed[i]).decode()] = listed[i]
            i += 1
    return device, bufts


def extra_buffers():
    """Names of the CPU backend's extra buffer types in this build on this CPU,
    in the order llama.cpp's loader tries them (it takes the first that accepts
    a weight's matmul), e.g. ["AMX", "CPU_REPACK"]."""
    if available() is not None:
        return []
    return list(_cpu_device_and_extra_buffers()[1])


def block_shape(qtype):
    """(elements, bytes) of a block of ggml type id `qtype`, from ggml's own table."""
    t = _LIBS[0].ggml_get_type_traits(qtype).contents
    return t.blck_size, t.type_size


def dequantize(raw, qtype):
    """ggml's own dequantize_row (its to_float) of raw blocks [rows, bytes] as
    float32 [rows, n]: an oracle for the types gguf-py cannot dequantize."""
    block, nbytes = block_shape(qtype)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    n = raw.shape[1] // nbytes * block
    out = np.empty((raw.shape[0], n), dtype=np.float32)
    to_float = _LIBS[0].ggml_get_type_traits(qtype).contents.to_float
    for r in range(raw.shape[0]):
        to_float(raw[r].ctypes.data, out[r].ctypes.data, n)
    return out


def quantize(x, qtype):
    """ggml's own reference quantizer (its from_float_ref, quantize_row_*_ref)
    of float32 x [rows, n] as raw blocks uint8 [rows, n / block * bytes]."""
    block, nbytes = block_shape(qtype)
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // block * nbytes), dtype=np.uint8)
    from_float = _FromFloat(_LIBS[0].ggml_get_type_traits(qtype).contents.from_float_ref)
    for r in range(x.shape[0]):
        from_float(x[r].ctypes.data, out[r].ctypes.data, x.shape[1])
    return out


class BufferRefused(ValueError):
    """The extra buffer type does not take this weight type or shape."""


def buffer_takes(qtype, rows, n, M, buffer):
    """Whether extra buffer type `buffer` takes this matmul, as the CPU device
    answers it in this process: W is allocated there, but no blocks are copied
    and nothing runs."""
    try:
        GgmlMatmul(None, qtype, rows, n, M, 1, buffer=buffer)
    except BufferRefused:
        return False
    return True


class _Graph:
    """A ggml context (self.ctx) holding one graph (self.graph) that computes
    on `threads` threads, planned once per thread count with a work buffer we
    own; subclasses build the graph."""

    def _set_graph(self, out, threads):
        self.graph = self._base.ggml_new_graph(self.ctx)
        self._base.ggml_build_forward_expand(self.graph, out)
        self.threads = threads
        self._plans = {}  # threads -> (plan, work buffer)

    def compute(self):
        if self.threads not in self._plans:
            plan = self._cpu.ggml_graph_plan(self.graph, self.threads, None)
            work = np.empty(max(plan.work_size, 1), dtype=np.uint8)
            plan.work_data = work.ctypes.data
            self._plans[self.threads] = (plan, work)
        plan, _ = self._plans[self.threads]
        status = self._cpu.ggml_graph_compute(self.graph, ctypes.byref(plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def _copy_in(self, tensor, array):
        ctypes.memmove(self._base.ggml_get_data(tensor), array.ctypes.data, array.nbytes)

    def _copy_out(self, tensor, shape):
        buf = (ctypes.c_float * int(np.prod(shape))).from_address(self._base.ggml_get_data(tensor))
        return np.frombuffer(buf, dtype=np.float32).reshape(shape).copy()

    def _release(self):
        if getattr(self, "_weight_buffer", None):
            self._base.ggml_backend_buffer_free(self._weight_buffer)
            self._weight_buffer = None
        for name in ("wctx", "ctx"):
            if getattr(self, name, None):
                self._base.ggml_free(getattr(self, name))
                setattr(self, name, None)

    def __del__(self):
        self._release()


class GgmlMatmul(_Graph):
    """out[M, rows] = x[M, n] @ dequant(W).T by ggml's CPU backend.

    buffer: None keeps W as the plain blocks (ggml_mul_mat's vec_dot path);
    the name of an extra buffer type (extra_buffers()) repacks W into it as
    llama.cpp's loader would, or raises BufferRefused if it does not take W.
    raw None leaves W without blocks (buffer_takes' question only).
    """

    def __init__(self, raw, qtype, rows, n, M, threads, buffer=None):
        if available() is not None:
            raise RuntimeError(available())
        base, self._cpu = _LIBS
        self._base = base
        self.buffer = buffer
        self._weight_buffer = self.wctx = None
        raw = None if raw is None else np.ascontiguousarray(raw, dtype=np.uint8)
        f32 = 0  # GGML_TYPE_F32
        # The context holds x, the output, the graph and a plain W (ggml aborts
        # the process if it runs out, so leave room); a W in an extra buffer
        # gets its own context with no data of its own.
        plain_bytes = 0 if buffer or raw is None else raw.nbytes
        self.ctx = base.ggml_init(_InitParams(plain_bytes + 8 * (n + rows) * M + (16 << 20), None, False))
        if not self.ctx:
            raise RuntimeError("ggml_init failed")
        if buffer:
            self.wctx = base.ggml_init(_InitParams(1 << 16, None, True))
            self.W = base.ggml_new_tensor_2d(self.wctx, int(qtype), n, rows)
        else:
            self.W = base.ggml_new_tensor_2d(self.ctx, int(qtype), n, rows)
        if raw is not None and base.ggml_nbytes(self.W) != raw.nbytes:
            raise ValueError(f"ggml expects {base.ggml_nbytes(self.W)} bytes for type {qtype}, got {raw.nbytes}")
        self.x = base.ggml_new_tensor_2d(self.ctx, f32, n, M)
        self.out = base.ggml_mul_mat(self.ctx, self.W, self.x)
        if buffer:
            self._place_weight(buffer, raw)
        elif raw is not None:
            self._copy_in(self.W, raw)
        self._set_graph(self.out, threads)
        self.shape = (M, n)
        self.rows = rows

    def _place_weight(self, buffer, raw):
        """Allocates W in extra buffer type `buffer` and hands it the blocks,
        which that buffer type repacks (as llama.cpp's loader does), after the
        CPU device confirmed that this matmul runs from such a buffer."""
        base = self._base
        device, bufts = _cpu_device_and_extra_buffers()
        if buffer not in bufts:
            raise BufferRefused(f"no extra buffer type {buffer!r} here (have: {', '.join(bufts) or 'none'})")
        self._weight_buffer = base.ggml_backend_alloc_ctx_tensors_from_buft(self.wctx, bufts[buffer])
        if not self._weight_buffer:
            raise RuntimeError(f"allocating W in {buffer} failed")
        if not base.ggml_backend_dev_supports_op(device, self.out):
            self._release()
            raise BufferRefused(f"{buffer} does not take this matmul")
        if raw is not None:
            base.ggml_backend_tensor_set(self.W, raw.ctypes.data, 0, raw.nbytes)

    def set_input(self, x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        assert x.shape == self.shape
        self._copy_in(self.x, x)

    def result(self):
        return self._copy_out(self.out, (self.shape[0], self.rows))


class GgmlMulMatId(_Graph):
    """out[t, s] = dequant(W[ids[t, s]]) @ x[t] (or x[t, s]) by ggml's
    ggml_mul_mat_id, llama.cpp's mixture-of-experts matmul, on the plain
    blocks: W the bytes of `experts` matrices of [rows, n] one after another
    (a GGUF expert tensor's data), ids [T, k] int32, x [T, n] for every
    slot (`per_slot` False) or [T, k, n]; out [T, k, rows]."""

    def __init__(self, raw, qtype, experts, rows, n, T, k, threads, per_slot=False):
        if available() is not None:
            raise RuntimeError(available())
        self._base, self._cpu = _LIBS
        base = self._base
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        f32, i32 = 0, 26  # GGML_TYPE_F32, GGML_TYPE_I32
        self.ctx = base.ggml_init(_InitParams(raw.nbytes + 4 * T * k * (n + rows + 1) + (16 << 20), None, False))
        if not self.ctx:
            raise RuntimeError("ggml_init failed")
        self.W = base.ggml_new_tensor_3d(self.ctx, int(qtype), n, rows, experts)
        if base.ggml_nbytes(self.W) != raw.nbytes:
            raise ValueError(f"ggml expects {base.ggml_nbytes(self.W)} bytes for type {qtype}, got {raw.nbytes}")
        self._copy_in(self.W, raw)
        self.x = base.ggml_new_tensor_3d(self.ctx, f32, n, k if per_slot else 1, T)
        self.ids = base.ggml_new_tensor_2d(self.ctx, i32, k, T)
        self.out = base.ggml_mul_mat_id(self.ctx, self.W, self.x, self.ids)
        self._set_graph(self.out, threads)
        self.shape, self.rows = (T, k if per_slot else 1, n), rows

    def set_input(self, x, ids):
        self._copy_in(self.x, np.ascontiguousarray(x, dtype=np.float32).reshape(self.shape))
        self._copy_in(self.ids, np.ascontiguousarray(ids, dtype=np.int32))

    def result(self):
        T, k = self.shape[0], self._base.ggml_nbytes(self.ids) // 4 // self.shape[0]
        return self._copy_out(self.out, (T, k, self.rows))


def _probe(nbytes, qtype, rows, n, M, threads, buffer):
    """What runs_in_subprocess runs in the child: one GgmlMatmul of zero blocks."""
    m = GgmlMatmul(np.zeros(nbytes, np.uint8), qtype, rows, n, M, threads, buffer=buffer)
    m.set_input(np.ones((M, n), np.float32))
    m.compute()


def runs_in_subprocess(nbytes, qtype, rows, n, M, threads, buffer):
    """None if a GgmlMatmul of this configuration (zero blocks) computes in a
    child process, else why not (the signal the child died of, or its last
    line of errors), so a caller can leave out a configuration that would
    kill its own process. Ask buffer_takes first: it costs no process. The
    child runs this file as a script (`python llama_cpp_peer.py --probe ...`),
    so it needs no import path of its own."""
    args = [nbytes, int(qtype), rows, n, M, threads, buffer]
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", *map(str, args)],
                          capture_output=True, text=True)
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"llama.cpp crashed (signal {-done.returncode})"
    last = done.stderr.strip().splitlines()
    return last[-1] if last else f"exit status {done.returncode}"


# Model level: llama.cpp's Llama on a whole GGUF file.

def llama_without_extra_buffers(**kwargs):
    """llama_cpp.Llama with llama.cpp's extra weight buffer types (repacked
    and AMX layouts) off: on a Xeon with AMX, llama-cpp-python 0.3.36 built
    for it (AMX_INT8 = 1) crashes with a segmentation fault in the first
    decode of a file with them on, and runs with them off. The plain CPU
    path computes the same 8-bit products, so it is the same reference.
    Llama takes no argument for it, so its default model parameters are
    wrapped while it loads."""
    import llama_cpp

    low_level = llama_cpp.llama.llama_cpp
    defaults = low_level.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffers
    try:
        llm = llama_cpp.Llama(**kwargs)
    finally:
        low_level.llama_model_default_params = defaults
    assert not llm.model_params.use_extra_bufts
    return llm


class LlamaCppLogits:
    """llama.cpp as a callable with the transformers output shape: the logits
    of every position of ids [1, T], from an empty context."""

    def __init__(self, llm):
        self.llm = llm

    def __call__(self, ids):
        import torch

        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        scores = np.array(self.llm.scores[: ids.shape[1]], dtype=np.float32)
        return type("Output", (), {"logits": torch.from_numpy(scores)[None]})


if __name__ == "__main__":
    # runs_in_subprocess's child: --probe nbytes qtype rows n M threads buffer
    if len(sys.argv) != 9 or sys.argv[1] != "--probe":
        sys.exit("usage: python llama_cpp_peer.py --probe NBYTES QTYPE ROWS N M THREADS BUFFER")
    *sizes, buffer = sys.argv[2:]
    _probe(*map(int, sizes), None if buffer == "None" else buffer)
