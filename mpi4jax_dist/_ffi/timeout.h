// The collective timeout (MPI4JAX_DIST_COLLECTIVE_TIMEOUT, set from
// mpi4jax_dist/faults/hangs.py): on, every wait of the handlers polls MPI_Test
// against a deadline; past it the call raises the process's alarm for the
// watchdog, or ends the job itself (MPI_Abort) where none runs. A timed-out
// call never returns: MPI may still write into XLA's buffer.

#ifndef MPI4JAX_DIST_FFI_TIMEOUT_H_
#define MPI4JAX_DIST_FFI_TIMEOUT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "mpi_base.h"

namespace mpi4jax_dist {

// Nanoseconds on the steady clock: the collective timeout's deadlines and the
// wait's counts of time.
MPI4JAX_DIST_CORE_API int64_t SteadyNs();

// What Python set (set_collective_timeout): the timeout (0: off), whether its
// watchdog thread runs (it needs MPI_THREAD_MULTIPLE), and whether SIGUSR1
// dumps this process's stacks.
struct TimeoutSettings {
  std::atomic<int64_t> timeout_ns{0};
  std::atomic<bool> watchdog{false};
  std::atomic<bool> stacks_on_signal{false};
};

MPI4JAX_DIST_CORE_API TimeoutSettings& GetTimeoutSettings();

// How long past its alarm a timed-out call waits for the watchdog to end the
// job before it ends it itself.
constexpr int64_t kAlarmGraceS = 60;

// The call this thread is in (XLA runs a handler on one thread from entry to
// return): what a timeout names.
struct CallContext {
  const char* who = "mpi4jax_dist.allreduce";
  int64_t comm_id = 0;
  // This call's number among the calls on its communicator in this process
  // (1 for the first); the watchdog compares it with the other ranks' counts.
  int64_t call = 0;
  int64_t deadline_ns = 0;  // 0: no timeout
  bool alarmed = false;
};

MPI4JAX_DIST_CORE_API CallContext& CurrentCall();

// Start the deadline of the call this thread enters now.
MPI4JAX_DIST_CORE_API void EnterCall(const char* who, int64_t comm_id,
                                     int64_t call);

// The first timed-out call of this process, for the watchdog.
struct Alarm {
  std::mutex mu;
  bool raised = false;
  std::string who;
  int64_t comm_id = 0;
  int64_t call = 0;
  double waited_s = 0;
};

MPI4JAX_DIST_CORE_API Alarm& GetAlarm();

// What a wait's request moves, where the caller does not say: as much as
// may need the polls themselves to progress.
constexpr size_t kUnknownBytes = SIZE_MAX;

// Complete `request`, which moves `bytes`: MPI_Wait without a timeout; with
// one, MPI_Test polled (each test under the MPI lock where MPI is
// serialized) and the deadline checked every 64 tests. A small message's wait
// (`bytes` up to kPausableBytes, timeout.cc) that lasts past 4 ms is a late
// rank's: it pauses between tests, for 1/64 of the time waited (at most 1
// ms), and leaves its core. Past the deadline the call raises the alarm, and
// where no watchdog ends the job in time, ends it (MPI_Abort).
MPI4JAX_DIST_CORE_API int WaitRequest(MPI_Request* request,
                                      size_t bytes = kUnknownBytes);

// Complete one of `n` requests, as WaitRequest does one: MPI_Waitany, or
// under the collective timeout MPI_Testany polled. *index says which;
// `bytes` is the most any of them moves.
MPI4JAX_DIST_CORE_API int WaitAnyRequest(int n, MPI_Request* requests,
                                         int* index,
                                         size_t bytes = kUnknownBytes);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_TIMEOUT_H_
