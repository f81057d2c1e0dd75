// lowbit's CPU thread pool (parallel.h): one job at a time, its chunks
// claimed through one atomic word, helpers that spin briefly between jobs
// and then sleep.
#include "parallel.h"

#include <ATen/Parallel.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace lowbit {
namespace cpu {
namespace {

inline void relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#endif
}

// How a helper waits for the next job: polling (tens of microseconds), then
// polling between yields of its core, for longer than the gap between two
// matmuls of a decode step (so it is awake for the next), then asleep. The
// yields let torch's own threads (at::mm, attention) run at full speed on a
// core a helper shares with them.
constexpr int kPausePolls = 2048;
constexpr auto kSpin = std::chrono::microseconds(2000);

// state: the job's generation in the high 32 bits, the next chunk to claim in
// the low 32. kClosed marks a generation whose fields are being written.
constexpr uint64_t kClosed = 0xffffffffu;
constexpr int64_t kMaxChunks = 0x7fffffff;

thread_local bool t_in_pool = false;

struct Pool {
  std::mutex post;  // held by the one caller whose job runs
  std::atomic<uint64_t> state{0};
  // The job's fields: written while its generation is closed, read by helpers
  // before a claim that proves the generation still open (see claim_chunks).
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<const void*> ctx{nullptr};
  std::atomic<int64_t> n{0}, chunk{1}, chunks{0}, helpers{0};
  std::atomic<int64_t> done{0};
  std::atomic<int> sleepers{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first, set under error_mutex
  std::mutex error_mutex;
  int started = 0;  // helper threads, under `post`

  // Claims and runs chunks of generation `gen` until none is left.
  void claim_chunks(uint64_t gen) {
    const ChunkFn f = fn.load(std::memory_order_relaxed);
    const void* c = ctx.load(std::memory_order_relaxed);
    const int64_t total = n.load(std::memory_order_relaxed), size = chunk.load(std::memory_order_relaxed),
                  count = chunks.load(std::memory_order_relaxed);
    uint64_t s = state.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t i = s & 0xffffffffu;
      if ((s >> 32) != gen || i >= static_cast<uint64_t>(count)) return;
      // Success proves generation `gen` was open, so the fields read above
      // (before this release-acquire step) are its own.
      if (!state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          const int64_t b = static_cast<int64_t>(i) * size;
          f(c, b, std::min(total, b + size));
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!failed.exchange(true)) error = std::current_exception();
        }
      }
      done.fetch_add(1, std::memory_order_release);
      s = state.load(std::memory_order_acquire);
    }
  }

  void helper(int64_t index) {
    t_in_pool = true;
    uint64_t seen = 0;
    for (;;) {
      // A helper past the jobs' count (left from a call on more threads)
      // sleeps until a job takes it: spinning, it would take the cores of
      // the helpers at work.
      for (int64_t h = helpers.load(std::memory_order_acquire); index >= h; h = helpers.load(std::memory_order_acquire))
        helpers.wait(h, std::memory_order_acquire);
      uint64_t s = state.load(std::memory_order_acquire);
      auto since = std::chrono::steady_clock::now();
      for (int polls = 0; (s >> 32) == seen || (s & 0xffffffffu) == kClosed; s = state.load(std::memory_order_acquire)) {
        if (++polls < kPausePolls) {
          relax();
        } else if (std::chrono::steady_clock::now() - since < kSpin) {
          std::this_thread::yield();  // a thread of torch's own pool on this core goes first
        } else {
          sleepers.fetch_add(1, std::memory_order_seq_cst);
          state.wait(s, std::memory_order_seq_cst);  // until state differs from s
          sleepers.fetch_sub(1, std::memory_order_relaxed);
          polls = 0;
          since = std::chrono::steady_clock::now();
        }
      }
      seen = s >> 32;
      if (index < helpers.load(std::memory_order_relaxed)) claim_chunks(seen);
    }
  }

  void run(int64_t total, int64_t size, int64_t count, int64_t threads, ChunkFn f, const void* c) {
    for (; started < threads - 1; ++started) std::thread(&Pool::helper, this, started).detach();
    const uint64_t gen = (state.load(std::memory_order_relaxed) >> 32) + 1;
    state.store(gen << 32 | kClosed, std::memory_order_seq_cst);
    fn.store(f, std::memory_order_relaxed);
    ctx.store(c, std::memory_order_relaxed);
    n.store(total, std::memory_order_relaxed);
    chunk.store(size, std::memory_order_relaxed);
    chunks.store(count, std::memory_order_relaxed);
    const int64_t before = helpers.exchange(threads - 1, std::memory_order_release);
    done.store(0, std::memory_order_relaxed);
    failed.store(false, std::memory_order_relaxed);
    error = nullptr;
    state.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) state.notify_all();
    if (threads - 1 > before) helpers.notify_all();  // helpers asleep past the last job's count
    claim_chunks(gen);
    // Every chunk is claimed; wait for the ones helpers still run.
    for (int polls = 0; done.load(std::memory_order_acquire) < count; ++polls) {
      if (polls < 4096) relax();
      else std::this_thread::yield();  // a helper on this core needs it to finish
    }
    if (failed.load(std::memory_order_acquire)) std::rethrow_exception(error);
  }
};

Pool* g_pool = nullptr;

Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] { g_pool = new Pool; });  // never destroyed: detached helpers use it until exit
  return *g_pool;
}

void run_serial(int64_t n, int64_t chunk, ChunkFn fn, const void* ctx) {
  for (int64_t b = 0; b < n; b += chunk) fn(ctx, b, std::min(n, b + chunk));
}

// A forked child has none of the parent's threads. Of lowbit's, it starts a
// new pool (the old one, possibly mid-job in another thread, is left alone).
// GNU OpenMP hangs the child's next parallel region of more than one thread
// (torch's own ops' too, where the parent ran one): TorchThreadsAtPool does
// not raise torch's count there.
std::atomic<bool> g_forked{false};
const int g_fork_hook = pthread_atfork(nullptr, nullptr, [] {
  g_forked.store(true);
  if (g_pool != nullptr) g_pool = new Pool;
});

}  // namespace

std::atomic<int64_t> g_threads{0};

int64_t pool_threads() {
  const int64_t set = g_threads.load(std::memory_order_relaxed);
  return set > 0 ? set : std::clamp<int64_t>(at::get_num_threads(), 1, kMaxPoolThreads);
}

int64_t pool_threads_setting() { return g_threads.load(std::memory_order_relaxed); }

void set_pool_threads(int64_t threads) { g_threads.store(threads, std::memory_order_relaxed); }

std::atomic<Team> g_team{Team::kPool};

Team kernel_team() { return g_team.load(std::memory_order_relaxed); }

void set_kernel_team(Team team) { g_team.store(team, std::memory_order_relaxed); }

TorchThreadsAtPool::TorchThreadsAtPool() {
  const int64_t threads = pool_threads(), torch_threads = at::get_num_threads();
  if (threads > torch_threads && !t_in_pool && !at::in_parallel_region() && !g_forked.load()) {
    saved_ = static_cast<int>(torch_threads);
    at::set_num_threads(static_cast<int>(threads));
  }
}

TorchThreadsAtPool::~TorchThreadsAtPool() {
  if (saved_ > 0) at::set_num_threads(saved_);
}

void run_chunks(int64_t n, int64_t chunk, ChunkFn fn, const void* ctx) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t count = (n + chunk - 1) / chunk;
  const int64_t threads = std::min(pool_threads(), count);
  if (threads <= 1 || count > kMaxChunks || t_in_pool || at::in_parallel_region()) {
    return run_serial(n, chunk, fn, ctx);
  }
  if (kernel_team() == Team::kTorch) {
    // Chunk by chunk within each range torch's threads take.
    at::parallel_for(0, count, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) fn(ctx, c * chunk, std::min(n, (c + 1) * chunk));
    });
    return;
  }
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.post, std::try_to_lock);
  if (!lock.owns_lock()) return run_serial(n, chunk, fn, ctx);  // another caller's job is running
  // The caller's chunks that call back in here run serially, as helpers' do.
  struct InPool {
    InPool() { t_in_pool = true; }
    ~InPool() { t_in_pool = false; }
  } in_pool;
  p.run(n, chunk, count, threads, fn, ctx);
}

}  // namespace cpu
}  // namespace lowbit
