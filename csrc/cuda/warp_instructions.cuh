// The instructions of the tensor-core kernels that have no CUDA C++
// intrinsic (cp.async, mma.sync, lop3), as typed wrappers.
//
// On the device each wrapper is its PTX instruction; cp.async and mma.sync
// exist from sm_80 on, and a build whose architecture list includes older ones
// compiles the kernels there without them (they never run there, and
// mma16816 traps if it did). Compiled as host code, the wrappers call the CPU
// emulator of the CUDA execution model (tests/simt/simt.h defines the
// lowbit::simt functions declared here), so the CPU tests run the kernels'
// own code on emulated warps; nvcc's host pass never emits those bodies.
#pragma once

#include <c10/macros/Macros.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace lowbit {
namespace simt {

// cp.async: `bytes` bytes to shared dst, the first src_bytes from src and
// zeros after them, in the calling thread's open group.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
// Completes the calling thread's groups but the `pending` newest.
void cp_async_wait(int pending);
// ldmatrix.sync.aligned.m8n8.x4.shared.b16 from the calling lane's row address.
void ldmatrix_x4(uint32_t (&d)[4], const void* row);
// mma.sync.m16n8k16.row.col with fp32 accumulators, fp16 or bf16 operands.
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16);
// mma.sync.m16n8k16.row.col with int32 accumulators, int8 operands.
void mma_m16n8k16_s8(int32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t b);

}  // namespace simt

namespace cuda {

// 16 bytes to shared memory, bypassing L1 (.cg); zeros where !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
#endif
#else
  simt::cp_async(dst, src, 16, valid ? 16 : 0);
#endif
}

// 4 bytes to shared memory (.ca: 4-byte copies cannot bypass L1).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
#endif
#else
  simt::cp_async(dst, src, 4, 4);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
#else
  simt::cp_async_commit();
#endif
}

// Waits until at most N of the thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
#else
  simt::cp_async_wait(N);
#endif
}

// Any function of three words, bit by bit: bit i of the result is bit
// (a_i << 2 | b_i << 1 | c_i) of Lut, which is F(0xF0, 0xCC, 0xAA) for the
// function F wanted (0xEA: (a & b) | c).
template <uint32_t Lut>
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b, uint32_t c) {
  static_assert(Lut < 256, "lop3 takes an 8-bit table");
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c), "n"(Lut));
  return r;
#else
  uint32_t r = 0;
  for (int i = 0; i < 32; ++i) {
    const uint32_t row = ((a >> i) & 1u) << 2 | ((b >> i) & 1u) << 1 | ((c >> i) & 1u);
    r |= ((Lut >> row) & 1u) << i;
  }
  return r;
#endif
}

// Four 8x8 matrices of 16-bit elements from shared memory: lane 8i + r
// gives the address of row r of matrix i (16 contiguous bytes, 16-byte
// aligned); d[i] gets, per lane, elements 2 (lane % 4) and 2 (lane % 4) + 1
// of row lane / 4 of matrix i (the lower one in the low half): an m16n8k16
// A fragment in one instruction.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&d)[4], const void* row) {
#if defined(__CUDA_ARCH__)
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(s));
#else
  simt::ldmatrix_x4(d, row);
#endif
}

// d += a (16x16, row) @ b (16x8, col) in fp32; T is __half or __nv_bfloat16.
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "mma16816 takes fp16 or bf16");
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  CUDA_KERNEL_ASSERT(false && "mma.sync needs compute capability 8.0");
#endif
#else
  simt::mma_m16n8k16(d, a, b0, b1, std::is_same_v<T, __nv_bfloat16>);
#endif
}

// d += a (16x16 int8, row) @ b (16x8 int8, col) in int32, exactly: a0 holds
// row lane / 4 and a1 row lane / 4 + 8, each at columns 4 (lane % 4) + 0..3;
// b holds rows 4 (lane % 4) + 0..3 of column lane / 4.
__device__ __forceinline__ void mma16816_s8(int32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a0), "r"(a1), "r"(b));
#else
  CUDA_KERNEL_ASSERT(false && "mma.sync needs compute capability 8.0");
#endif
#else
  simt::mma_m16n8k16_s8(d, a0, a1, b);
#endif
}

}  // namespace cuda
}  // namespace lowbit
