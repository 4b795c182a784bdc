// What the handlers did, counted where it runs: the core's counts, one set a
// process, which each module's stats() reads and mpi4jax_dist.op_counts()
// (ops/counts.py), a public diagnostic, returns.

#ifndef MPI4JAX_DIST_FFI_STATS_H_
#define MPI4JAX_DIST_FFI_STATS_H_

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "mpi_base.h"

namespace mpi4jax_dist {

// What the handlers did: a count of what ran, not of what was asked for.
// Relaxed atomics: handlers run on XLA's worker threads.
struct MPI4JAX_DIST_CORE_API Stats {
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

  // Set every count to zero.
  void Reset();
};

// The counts of this process (the core's: one for every module).
MPI4JAX_DIST_CORE_API Stats& GetStats();

// Name and value of each count, as every module's stats() names them.
using StatsItems = std::vector<std::pair<const char*, int64_t>>;

MPI4JAX_DIST_CORE_API StatsItems GetStatsItems();

// Count a handler call, and whether XLA gave it one buffer (in place).
MPI4JAX_DIST_CORE_API void CountHandlerCall(const void* operand,
                                            const void* result);

// What the non-blocking handlers did (op_counts' iallreduce_* keys).
struct MPI4JAX_DIST_CORE_API RequestStats {
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

  // Set every count to zero.
  void Reset();
};

MPI4JAX_DIST_CORE_API RequestStats& GetRequestStats();

MPI4JAX_DIST_CORE_API StatsItems GetRequestStatsItems();

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_STATS_H_
