// Work split for the CPU kernels: many small chunks of a loop whose chunks
// own disjoint outputs, run by lowbit's own thread pool (parallel.cpp).
//
// A caller never waits for a thread that has not started: it runs chunks
// itself as soon as it posts them and waits only for chunks other threads
// have claimed. An OpenMP region (at::parallel_for) ends on a barrier that
// every thread of the team must reach, so one thread the OS has descheduled
// (another process on its core) stalls each call for a scheduler time slice,
// and a decode step makes hundreds of such calls. Here that thread just takes
// no chunks. Chunks compute the same values whoever runs them, so results do
// not depend on the thread count or on timing.
#pragma once

#include <stdint.h>

#include <algorithm>

namespace lowbit {
namespace cpu {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs fn(ctx, b, e) over [0, n) in chunks [b, e) of `chunk` (the last may be
// shorter), in parallel over torch's thread count (at::get_num_threads()).
// Serial, chunk by chunk in order, with one thread, one chunk, from inside a
// pool thread or an OpenMP region, or while another caller's job runs. The
// first exception a chunk throws is rethrown here after every chunk ran.
void run_chunks(int64_t n, int64_t chunk, ChunkFn fn, const void* ctx);

// How many threads (the caller included) take chunks: set_pool_threads's
// count, or torch's (at::get_num_threads()) while that is 0, the default,
// at most kMaxPoolThreads.
constexpr int64_t kMaxPoolThreads = 1024;
int64_t pool_threads();
int64_t pool_threads_setting();
void set_pool_threads(int64_t threads);

// Which threads run a loop: lowbit's pool, or torch's OpenMP team
// (at::parallel_for). set_kernel_team(Team::kTorch) sends run_chunks' jobs to
// torch's team: for calls whose torch ops want every thread too
// (lowbit.kernel_threads over a prompt), one team then runs everything,
// where two on the same cores would take turns (OpenMP's threads keep
// spinning after each region, the pool's between jobs).
enum class Team { kPool, kTorch };
Team kernel_team();
void set_kernel_team(Team team);

// For its lifetime, torch's own parallel ops (at::mm) run on pool_threads()
// threads where torch's count is lower: lowbit.kernel_threads holds torch at
// one thread during a model's forward and gives the others to the pool, so a
// kernel that hands its work to at::mm (gptq_gemm's large-M paths) takes them
// back. Nothing changes inside an OpenMP region or in a forked child.
class TorchThreadsAtPool {
 public:
  TorchThreadsAtPool();
  ~TorchThreadsAtPool();
  TorchThreadsAtPool(const TorchThreadsAtPool&) = delete;
  TorchThreadsAtPool& operator=(const TorchThreadsAtPool&) = delete;

 private:
  int saved_ = 0;  // torch's count to restore, or 0 where nothing changed
};

template <class F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  run_chunks(n, chunk, [](const void* c, int64_t b, int64_t e) { (*static_cast<const F*>(c))(b, e); }, &fn);
}

// at::parallel_for's contract over [0, n): fn(b, e) on ranges of at least
// `grain` (all of [0, n) at once when it is smaller), in about four chunks
// per thread so that a slow thread's share is taken by the others.
constexpr int64_t kChunksPerThread = 4;

template <class F>
void parallel_for(int64_t n, int64_t grain, const F& fn) {
  const int64_t parts = kChunksPerThread * pool_threads();
  parallel_chunks(n, std::max<int64_t>({int64_t{1}, grain, (n + parts - 1) / parts}), fn);
}

}  // namespace cpu
}  // namespace lowbit
