"""llama.cpp's CPU backend as an independent reference and benchmark peer:
one ggml_mul_mat of a given quant type, on the same blocks as lowbit
(tests/test_llama_cpp_ggml.py, benchmarks/bench_gguf.py).

ggml is reached through the shared libraries that PyPI's llama-cpp-python
builds and ships (llama_cpp/lib/libggml-base.so, libggml-cpu.so), with a few
ctypes declarations of ggml's public C API (ggml.h, ggml-cpu.h): a context
that owns the tensors, W as an [n, rows] tensor of the quant type holding
lowbit's bytes, x as [n, M] fp32, and ggml_graph_compute_with_ctx with
n_threads, planned once per thread count (ggml_graph_plan) with a work buffer
we own: ggml_graph_compute_with_ctx would take a new work buffer from the
context on every call. ggml quantizes x to the type's 8-bit activation blocks
inside the call, as lowbit does. An optional extra: `pip install llama-cpp-python`.
"""
import ctypes
import os

import numpy as np


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):  # struct ggml_cplan of the ggml that llama-cpp-python 0.3.36 vendors
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


def _load():
    import llama_cpp  # noqa: F401  (the package that ships the libraries)

    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    base = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    base.ggml_init.argtypes, base.ggml_init.restype = [_InitParams], p
    base.ggml_free.argtypes, base.ggml_free.restype = [p], None
    base.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_new_tensor_2d.restype = p
    base.ggml_get_data.argtypes, base.ggml_get_data.restype = [p], p
    base.ggml_nbytes.argtypes, base.ggml_nbytes.restype = [p], ctypes.c_size_t
    base.ggml_mul_mat.argtypes, base.ggml_mul_mat.restype = [p, p, p], p
    base.ggml_new_graph.argtypes, base.ggml_new_graph.restype = [p], p
    base.ggml_build_forward_expand.argtypes, base.ggml_build_forward_expand.restype = [p, p], None
    cpu.ggml_graph_plan.argtypes, cpu.ggml_graph_plan.restype = [p, ctypes.c_int, p], _CPlan
    cpu.ggml_graph_compute.argtypes = [p, ctypes.POINTER(_CPlan)]
    cpu.ggml_graph_compute.restype = ctypes.c_int
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    cpu.ggml_cpu_init()
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


class GgmlMatmul:
    """out[M, rows] = x[M, n] @ dequant(W).T by ggml's CPU backend."""

    def __init__(self, raw, qtype, rows, n, M, threads):
        if available() is not None:
            raise RuntimeError(available())
        base, self._cpu = _LIBS
        self._base = base
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        f32 = 0  # GGML_TYPE_F32
        # The context holds W, x, the output and the graph (ggml aborts the
        # process if it runs out, so leave room).
        self.ctx = base.ggml_init(_InitParams(raw.nbytes + 8 * (n + rows) * M + (16 << 20), None, False))
        if not self.ctx:
            raise RuntimeError("ggml_init failed")
        self.W = base.ggml_new_tensor_2d(self.ctx, int(qtype), n, rows)
        if base.ggml_nbytes(self.W) != raw.nbytes:
            raise ValueError(f"ggml expects {base.ggml_nbytes(self.W)} bytes for type {qtype}, got {raw.nbytes}")
        ctypes.memmove(base.ggml_get_data(self.W), raw.ctypes.data, raw.nbytes)
        self.x = base.ggml_new_tensor_2d(self.ctx, f32, n, M)
        self.out = base.ggml_mul_mat(self.ctx, self.W, self.x)
        self.graph = base.ggml_new_graph(self.ctx)
        base.ggml_build_forward_expand(self.graph, self.out)
        self.shape = (M, n)
        self.rows = rows
        self.threads = threads
        self._plans = {}  # threads -> (plan, work buffer)

    def set_input(self, x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        assert x.shape == self.shape
        ctypes.memmove(self._base.ggml_get_data(self.x), x.ctypes.data, x.nbytes)

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

    def result(self):
        M = self.shape[0]
        buf = (ctypes.c_float * (M * self.rows)).from_address(self._base.ggml_get_data(self.out))
        return np.frombuffer(buf, dtype=np.float32).reshape(M, self.rows).copy()

    def __del__(self):
        if getattr(self, "ctx", None):
            self._base.ggml_free(self.ctx)
            self.ctx = None
