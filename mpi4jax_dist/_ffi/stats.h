// What the handlers did, counted where it runs: each module's stats(), which
// mpi4jax_dist.op_counts() (ops/counts.py), a public diagnostic, sums.

#ifndef MPI4JAX_DIST_FFI_STATS_H_
#define MPI4JAX_DIST_FFI_STATS_H_

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace mpi4jax_dist {

// What the handlers did: a count of what ran, not of what was asked for.
// Relaxed atomics: handlers run on XLA's worker threads.
struct Stats {
  std::atomic<int64_t> handler_calls{0};
  // Handler calls where XLA gave one buffer for operand and result (in place).
  std::atomic<int64_t> same_buffer_calls{0};
  // MPI reduction calls made, and of those the large-count (MPI_Allreduce_c)
  // ones.
  std::atomic<int64_t> mpi_calls{0};
  std::atomic<int64_t> large_count_calls{0};
  // Largest element count handed to one MPI call.
  std::atomic<int64_t> max_call_count{0};
  // MPI calls (or short runs of them) made holding the MPI lock (MpiGuard):
  // 0 under MPI_THREAD_MULTIPLE.
  std::atomic<int64_t> locked_sections{0};

  void Reset() {
    handler_calls = 0;
    same_buffer_calls = 0;
    mpi_calls = 0;
    large_count_calls = 0;
    max_call_count = 0;
    locked_sections = 0;
  }
};

inline Stats& GetStats() {
  static Stats stats;
  return stats;
}

// Name and value of each count, as every module's stats() names them.
using StatsItems = std::vector<std::pair<const char*, int64_t>>;

inline StatsItems GetStatsItems() {
  const Stats& s = GetStats();
  return {
      {"handler_calls", s.handler_calls.load()},
      {"same_buffer_calls", s.same_buffer_calls.load()},
      {"mpi_calls", s.mpi_calls.load()},
      {"large_count_calls", s.large_count_calls.load()},
      {"max_call_count", s.max_call_count.load()},
      {"locked_sections", s.locked_sections.load()},
  };
}

// Count a handler call, and whether XLA gave it one buffer (in place).
inline void CountHandlerCall(const void* operand, const void* result) {
  Stats& stats = GetStats();
  stats.handler_calls.fetch_add(1, std::memory_order_relaxed);
  if (operand == result) {
    stats.same_buffer_calls.fetch_add(1, std::memory_order_relaxed);
  }
}

// What the non-blocking handlers did (op_counts' iallreduce_* keys).
struct RequestStats {
  std::atomic<int64_t> starts{0};
  std::atomic<int64_t> large_count_starts{0};
  std::atomic<int64_t> waits{0};
  // Waits whose first MPI_Test completed the reduction: nothing was left to
  // wait for. That test progresses the reduction too, so this alone does not
  // say that the MPI moved it on during the overlapped work (wait_blocked_ns,
  // and work without MPI calls, do).
  std::atomic<int64_t> done_before_wait{0};
  // Nanoseconds from the posts to their waits, summed: the work overlapped (and
  // any waiting for other ranks inside it).
  std::atomic<int64_t> wait_slack_ns{0};
  // Nanoseconds the waits spent waiting (MPI_Wait) after their first
  // MPI_Test, summed: what the overlapped work did not hide. A wait whose
  // first test completed it adds nothing.
  std::atomic<int64_t> wait_blocked_ns{0};
  std::atomic<int64_t> tests{0};
  // Tests (Request.test) that found the reduction complete.
  std::atomic<int64_t> tests_done{0};
  std::atomic<int64_t> max_pending{0};

  void Reset() {
    starts = 0;
    large_count_starts = 0;
    waits = 0;
    done_before_wait = 0;
    wait_slack_ns = 0;
    wait_blocked_ns = 0;
    tests = 0;
    tests_done = 0;
    max_pending = 0;
  }
};

inline RequestStats& GetRequestStats() {
  static RequestStats stats;
  return stats;
}

inline StatsItems GetRequestStatsItems() {
  const RequestStats& r = GetRequestStats();
  return {
      {"iallreduce_starts", r.starts.load()},
      {"iallreduce_large_count_starts", r.large_count_starts.load()},
      {"iallreduce_waits", r.waits.load()},
      {"iallreduce_done_before_wait", r.done_before_wait.load()},
      {"iallreduce_wait_slack_ns", r.wait_slack_ns.load()},
      {"iallreduce_wait_blocked_ns", r.wait_blocked_ns.load()},
      {"iallreduce_tests", r.tests.load()},
      {"iallreduce_tests_done", r.tests_done.load()},
      {"iallreduce_max_pending", r.max_pending.load()},
  };
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_STATS_H_
