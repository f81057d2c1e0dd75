// A CPU emulator of the CUDA execution model, enough to run lowbit's kernels
// as host code in the CPU tests: the kernels' own source, compiled by the host
// compiler, on emulated blocks and warps.
//
// - Each thread of a block is an OS thread; the blocks of a grid run one after
//   another. __shared__ variables become function statics, which the threads of
//   the running block share.
// - __syncthreads is a barrier of the block's threads; warp-collective
//   operations (votes, shuffles, ldmatrix, mma.sync) a barrier of the warp's
//   32 lanes around an exchange of their values. Every lane of a warp must
//   take part (full masks only), as the kernels require.
// - cp.async copies wait in their thread's groups until cp.async.wait_group
//   completes them, the latest a GPU may, or complete at issue, the earliest
//   (Launch::copies_at_issue): a stage read before its wait, or overwritten
//   while another warp reads it, gives wrong results in one of the two. A copy
//   from outside the launch's global buffers (Launch::global) is skipped and
//   launch() throws once the grid has run.
// - mma.sync follows the PTX ISA's m16n8k16 fragment layouts (groupID = lane / 4,
//   threadID_in_group = lane % 4): fp16 / bf16 operands sum the 16 products of
//   each output in double, rounded once to the fp32 accumulator; int8 operands
//   sum exactly into int32. ldmatrix .x4 follows its m8n8 .b16 layout: lane
//   8i + r addresses row r of matrix i; lane l gets elements 2 (l % 4) and
//   2 (l % 4) + 1 of row l / 4 of each.
//
// Include this before any kernel header; it declares the CUDA built-ins the
// host compiler lacks (threadIdx, __syncthreads, __shfl_xor_sync, ...).
#pragma once

// The shared helpers' device paths (core/host_device.h: LOWBIT_DEVICE_PATH).
#define LOWBIT_SIMT_HOST 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace lowbit {
namespace simt {

// A misuse that leaves the warp unable to go on (its lanes would wait for
// each other forever): the process stops.
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "simt: %s\n", what);
  std::abort();
}

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    const uint64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_;
  int count_ = 0;
  uint64_t gen_ = 0;
};

struct Warp {
  Barrier barrier{32};
  uint64_t value[32];     // a vote's or shuffle's operand per lane
  uint32_t frag[32][6];   // an mma's A (4 words) and B (2 words) fragments per lane
};

struct Block {
  explicit Block(int threads) : barrier(threads), warps(new Warp[threads / 32]) {}
  Barrier barrier;
  std::unique_ptr<Warp[]> warps;
};

struct Copy {
  void* dst;
  const void* src;
  int bytes;
  int src_bytes;
  void run() const {
    if (src_bytes > 0) std::memcpy(dst, src, static_cast<size_t>(src_bytes));
    std::memset(static_cast<char*>(dst) + src_bytes, 0, static_cast<size_t>(bytes - src_bytes));
  }
};

struct Range {
  const void* begin;
  size_t bytes;
};

// The first error the threads of a launch report.
struct Errors {
  std::mutex m;
  std::string first;
  void report(const std::string& what) {
    std::lock_guard<std::mutex> lock(m);
    if (first.empty()) first = what;
  }
};

struct Thread {
  uint3 thread_idx{};
  uint3 block_idx{};
  dim3 block_dim;
  dim3 grid_dim;
  Block* block = nullptr;
  bool copies_at_issue = false;
  const std::vector<Range>* global = nullptr;
  Errors* errors = nullptr;
  std::vector<Copy> open;                // cp.async copies since the last commit
  std::deque<std::vector<Copy>> groups;  // committed groups, oldest first
};

inline Thread& self() {
  static thread_local Thread t;
  return t;
}
inline int lane() { return static_cast<int>(self().thread_idx.x % 32); }
inline Warp& warp() { return self().block->warps[self().thread_idx.x / 32]; }

inline void check_full(unsigned mask) {
  if (mask != 0xffffffffu) fail("a warp-collective operation without all 32 lanes is not emulated");
}

// Every lane's 64-bit value after all lanes have posted theirs.
template <typename F>
inline auto exchange(uint64_t mine, F&& read) {
  Warp& w = warp();
  w.value[lane()] = mine;
  w.barrier.wait();
  const auto r = read(w.value);
  w.barrier.wait();  // nobody posts the next value before every lane has read this one
  return r;
}

inline bool in_global(const void* src, int bytes) {
  const auto* p = static_cast<const char*>(src);
  for (const Range& r : *self().global) {
    const auto* b = static_cast<const char*>(r.begin);
    if (p >= b && p + bytes <= b + r.bytes) return true;
  }
  return false;
}

inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  if (src_bytes > 0 && !in_global(src, src_bytes)) {
    self().errors->report("cp.async reads outside the launch's global buffers (thread " +
                          std::to_string(self().thread_idx.x) + " of block " + std::to_string(self().block_idx.x) +
                          ")");
    return;
  }
  const Copy c{dst, src, bytes, src_bytes};
  if (self().copies_at_issue) {
    c.run();
  } else {
    self().open.push_back(c);
  }
}
inline void cp_async_commit() {
  Thread& t = self();
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}
inline void cp_async_wait(int pending) {
  Thread& t = self();
  while (static_cast<int>(t.groups.size()) > pending) {
    for (const Copy& c : t.groups.front()) c.run();
    t.groups.pop_front();
  }
}

inline float half_bits_to_float(uint16_t v, bool bf16) {
  if (bf16) {
    const uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  __half_raw raw;
  raw.x = v;
  return __half2float(__half(raw));
}

inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  Warp& w = warp();
  const int l = lane();
  for (int r = 0; r < 4; ++r) w.frag[l][r] = a[r];
  w.frag[l][4] = b0;
  w.frag[l][5] = b1;
  w.barrier.wait();
  // Element (row, k) of A: lane (row % 8) * 4 + (k % 8) / 2, register
  // (row >= 8) + 2 (k >= 8), half k % 2. Element (k, col) of B: lane col * 4
  // + (k % 8) / 2, register b0 (k < 8) or b1, half k % 2. Accumulator r: row
  // lane / 4 + 8 (r >= 2), column 2 (lane % 4) + r % 2.
  auto elem = [&](int src_lane, int reg, int k) {
    return half_bits_to_float(static_cast<uint16_t>(w.frag[src_lane][reg] >> (16 * (k % 2))), bf16);
  };
  float out[4];
  for (int r = 0; r < 4; ++r) {
    const int row = l / 4 + 8 * (r / 2), col = 2 * (l % 4) + r % 2;
    double s = d[r];
    for (int k = 0; k < 16; ++k) {
      const double x = elem((row % 8) * 4 + (k % 8) / 2, (row >= 8) + 2 * (k >= 8), k);
      const double y = elem(col * 4 + (k % 8) / 2, 4 + (k >= 8), k);
      s += x * y;
    }
    out[r] = static_cast<float>(s);
  }
  w.barrier.wait();
  for (int r = 0; r < 4; ++r) d[r] = out[r];
}

// Element (row, k) of A: lane (row % 8) * 4 + k / 4, register row >= 8,
// byte k % 4. Element (k, col) of B: lane col * 4 + k / 4, byte k % 4.
// Accumulators as mma_m16n8k16's; the int32 sums wrap as the hardware's do.
inline void ldmatrix_x4(uint32_t (&d)[4], const void* row) {
  const int l = lane();
  exchange(reinterpret_cast<uintptr_t>(row), [&](const uint64_t* rows) {
    for (int i = 0; i < 4; ++i) {
      std::memcpy(&d[i], reinterpret_cast<const char*>(rows[8 * i + l / 4]) + 4 * (l % 4), 4);
    }
    return 0;
  });
}

inline void mma_m16n8k16_s8(int32_t (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  Warp& w = warp();
  const int l = lane();
  w.frag[l][0] = a0;
  w.frag[l][1] = a1;
  w.frag[l][4] = b;
  w.barrier.wait();
  auto byte = [&](int src_lane, int reg, int k) { return static_cast<int8_t>(w.frag[src_lane][reg] >> (8 * (k % 4))); };
  int32_t out[4];
  for (int r = 0; r < 4; ++r) {
    const int row = l / 4 + 8 * (r / 2), col = 2 * (l % 4) + r % 2;
    int64_t s = d[r];
    for (int k = 0; k < 16; ++k) s += int64_t{byte((row % 8) * 4 + k / 4, row >= 8, k)} * byte(col * 4 + k / 4, 4, k);
    out[r] = static_cast<int32_t>(static_cast<uint32_t>(s));
  }
  w.barrier.wait();
  for (int r = 0; r < 4; ++r) d[r] = out[r];
}

struct Launch {
  dim3 grid;
  dim3 block;
  bool copies_at_issue = false;
  std::vector<Range> global;  // the buffers cp.async may read
};

// Runs kernel() (a call of the kernel with its arguments) on every thread of
// every block of the launch; throws std::runtime_error with the first error
// a thread reported.
template <typename Kernel>
void launch(const Launch& cfg, Kernel&& kernel) {
  Errors errors;
  const int threads = static_cast<int>(cfg.block.x * cfg.block.y * cfg.block.z);
  if (cfg.block.y != 1 || cfg.block.z != 1 || threads % 32 != 0) {
    throw std::invalid_argument("simt: only 1-D blocks of whole warps are emulated");
  }
  for (unsigned z = 0; z < cfg.grid.z; ++z)
    for (unsigned y = 0; y < cfg.grid.y; ++y)
      for (unsigned x = 0; x < cfg.grid.x; ++x) {
        Block blk(threads);
        std::vector<std::thread> pool;
        pool.reserve(static_cast<size_t>(threads));
        for (int i = 0; i < threads; ++i) {
          pool.emplace_back([&, i] {
            Thread& t = self();
            t.thread_idx = uint3{static_cast<unsigned>(i), 0, 0};
            t.block_idx = uint3{x, y, z};
            t.block_dim = cfg.block;
            t.grid_dim = cfg.grid;
            t.block = &blk;
            t.copies_at_issue = cfg.copies_at_issue;
            t.global = &cfg.global;
            t.errors = &errors;
            kernel();
            bool in_flight = !t.open.empty();
            for (const std::vector<Copy>& g : t.groups) in_flight |= !g.empty();
            if (in_flight) errors.report("a thread ended with cp.async copies in flight");
            t.open.clear();
            t.groups.clear();
          });
        }
        for (std::thread& th : pool) th.join();
      }
  if (!errors.first.empty()) throw std::runtime_error("simt: " + errors.first);
}

}  // namespace simt
}  // namespace lowbit

// The CUDA built-ins the kernels use, for the host compiler.
#define threadIdx (::lowbit::simt::self().thread_idx)
#define blockIdx (::lowbit::simt::self().block_idx)
#define blockDim (::lowbit::simt::self().block_dim)
#define gridDim (::lowbit::simt::self().grid_dim)
#undef __shared__
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

inline void __syncthreads() { ::lowbit::simt::self().block->barrier.wait(); }

inline int __all_sync(unsigned mask, int pred) {
  ::lowbit::simt::check_full(mask);
  return ::lowbit::simt::exchange(pred != 0, [](const uint64_t* v) {
    for (int i = 0; i < 32; ++i)
      if (!v[i]) return 0;
    return 1;
  });
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
  ::lowbit::simt::check_full(mask);
  return ::lowbit::simt::exchange(pred != 0, [](const uint64_t* v) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= static_cast<unsigned>(v[i] != 0) << i;
    return r;
  });
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move up to 8 bytes");
  ::lowbit::simt::check_full(mask);
  if (width != 32) ::lowbit::simt::fail("only 32-lane shuffles are emulated");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  const int src = ::lowbit::simt::lane() ^ (lane_mask & 31);
  return ::lowbit::simt::exchange(bits, [&](const uint64_t* v) {
    T r;
    std::memcpy(&r, &v[src], sizeof(T));
    return r;
  });
}

// Byte k of the result is byte (s >> 4k) & 7 of the eight bytes x, y.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t bytes = (uint64_t{y} << 32) | x;
  unsigned r = 0;
  for (int k = 0; k < 4; ++k) r |= static_cast<unsigned>((bytes >> (8 * ((s >> (4 * k)) & 7))) & 0xffu) << (8 * k);
  return r;
}

inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  return static_cast<unsigned>(((uint64_t{hi} << 32) | lo) >> (shift & 31));
}

// c plus the four products of the signed bytes of a and b.
inline int __dp4a(int a, int b, int c) {
  for (int k = 0; k < 4; ++k) c += static_cast<int8_t>(a >> (8 * k)) * static_cast<int8_t>(b >> (8 * k));
  return c;
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

template <typename T>
inline T __ldg(const T* p) {
  return *p;
}

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp16 fma per half: the product of two halves is exact in double; the sum
// is rounded to double, then to fp16 (a tie after the first rounding may
// round the other way; the kernels' sums are exact).
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) {
  auto one = [](float x, float y, float z) { return __double2half(std::fma(double{x}, double{y}, double{z})); };
  return __halves2half2(one(__low2float(a), __low2float(b), __low2float(c)),
                        one(__high2float(a), __high2float(b), __high2float(c)));
}
