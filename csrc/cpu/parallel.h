// Work split for the CPU kernels whose tasks are many equal chunks of a
// memory-bound loop (matmul rows / columns).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <stdint.h>

namespace lowbit {
namespace cpu {

// Runs fn(begin, end) over [0, n) in chunks of `chunk`, handed to torch's
// threads one at a time as each finishes its last, as llama.cpp's CPU backend
// does. at::parallel_for alone gives each thread a fixed share, so one thread
// delayed by the OS (common on shared or virtual machines) holds up the whole
// call; here it just takes fewer chunks. Chunks own disjoint outputs and
// compute them the same way whoever runs them: results do not depend on the
// thread count.
template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  const int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace cpu
}  // namespace lowbit
