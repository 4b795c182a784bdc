// The collective timeout (timeout.h): its settings, this thread's call, the
// process's alarm, and the waits that poll against a deadline.

#include "timeout.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "mpi_guard.h"

namespace mpi4jax_dist {

// Nanoseconds on the steady clock: the collective timeout's deadlines and the
// wait's counts of time.
int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

TimeoutSettings& GetTimeoutSettings() {
  static TimeoutSettings settings;
  return settings;
}

CallContext& CurrentCall() {
  thread_local CallContext context;
  return context;
}

// Start the deadline of the call this thread enters now.
void EnterCall(const char* who, int64_t comm_id, int64_t call) {
  CallContext& context = CurrentCall();
  const int64_t timeout = GetTimeoutSettings().timeout_ns.load();
  context.who = who;
  context.comm_id = comm_id;
  context.call = call;
  context.deadline_ns = timeout > 0 ? SteadyNs() + timeout : 0;
  context.alarmed = false;
}

Alarm& GetAlarm() {
  static Alarm* alarm = new Alarm();  // never destroyed, as the MPI lock
  return *alarm;
}

namespace {

int WorldRank() {
  int rank = -1;
  MpiGuard guard;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

// No watchdog, or none that ended the job in time: say so and end the job.
[[noreturn]] void AbortTimedOut(const CallContext& context, const char* why) {
  const double timeout_s = GetTimeoutSettings().timeout_ns.load() / 1e9;
  if (GetTimeoutSettings().stacks_on_signal.load()) {
    // Python's faulthandler dumps this process's stacks into a pipe, which
    // the _stacks module's C thread writes out (stacks.c): it needs a moment.
    std::raise(SIGUSR1);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  std::fprintf(stderr,
               "mpi4jax_dist: rank %d: %s (call %lld on communicator id %lld) "
               "waited %g s (MPI4JAX_DIST_COLLECTIVE_TIMEOUT); %s; MPI_Abort "
               "ends the job.\n",
               WorldRank(), context.who, static_cast<long long>(context.call),
               static_cast<long long>(context.comm_id), timeout_s, why);
  std::fflush(stderr);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

// Past the deadline: raise the alarm once (or end the job where no watchdog
// will); kAlarmGraceS later, end the job here.
void CheckDeadline(CallContext& context) {
  if (context.deadline_ns == 0) return;
  const int64_t now = SteadyNs();
  if (now <= context.deadline_ns) return;
  const TimeoutSettings& settings = GetTimeoutSettings();
  if (!context.alarmed) {
    context.alarmed = true;
    if (!settings.watchdog.load()) {
      AbortTimedOut(context,
                    "no watchdog asks the other ranks (it needs "
                    "MPI_THREAD_MULTIPLE and more than one rank)");
    }
    Alarm& alarm = GetAlarm();
    std::lock_guard<std::mutex> lock(alarm.mu);
    if (!alarm.raised) {
      alarm.raised = true;
      alarm.who = context.who;
      alarm.comm_id = context.comm_id;
      alarm.call = context.call;
      alarm.waited_s =
          (now - context.deadline_ns) / 1e9 + settings.timeout_ns.load() / 1e9;
    }
    return;
  }
  if (now > context.deadline_ns + kAlarmGraceS * 1000000000LL) {
    AbortTimedOut(context, "the watchdog did not end the job in time");
  }
}

// A wait polled against the deadline spins while it is short, as ranks in
// step wait. A small message's (up to kPausableBytes, which MPI moves in well
// under kSpinNs) that has lasted kSpinNs waits for a late rank: it pauses
// between its tests for 1/64 of the time waited so far (at most kMaxPauseNs).
// That adds at most about 1/64 to a wait that long, plus the sleep's slack
// (~50 us), and leaves the core, and the MPI lock where MPI is serialized, to
// the rank's other threads (XLA's, the watchdog's) and to the other ranks of
// a node with more ranks than cores, for as long as the late rank keeps this
// one waiting. A larger message's transfer progresses only in the tests
// (pausing slowed a 64 MiB allreduce by about 10 %): it spins.
constexpr size_t kPausableBytes = 64 * 1024;
constexpr int64_t kSpinNs = 4000000;
constexpr int64_t kMaxPauseNs = 1000000;

class Pauses {
 public:
  explicit Pauses(size_t bytes) : pausable_(bytes <= kPausableBytes) {}

  // After the `test`-th test (from 1) found the request pending.
  void After(uint32_t test) {
    if (!pausable_) return;
    if (!patient_) {
      if (test % 64 != 0 || SteadyNs() - start_ns_ < kSpinNs) return;
      patient_ = true;
    }
    const int64_t pause = std::min((SteadyNs() - start_ns_) / 64, kMaxPauseNs);
    std::this_thread::sleep_for(std::chrono::nanoseconds(pause));
  }

 private:
  const bool pausable_;
  const int64_t start_ns_ = SteadyNs();
  bool patient_ = false;
};

}  // namespace

// Complete `request`: MPI_Wait without a timeout; with one, MPI_Test polled
// (each test under the MPI lock where MPI is serialized) and the deadline
// checked every 64 tests.
int WaitRequest(MPI_Request* request, size_t bytes) {
  CallContext& context = CurrentCall();
  if (context.deadline_ns == 0) {
    MpiGuard guard;
    return MPI_Wait(request, MPI_STATUS_IGNORE);
  }
  Pauses pauses(bytes);
  for (uint32_t i = 1;; ++i) {
    int done = 0, rc = MPI_SUCCESS;
    {
      MpiGuard guard;
      rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS || done) return rc;
    if (i % 64 == 0) CheckDeadline(context);
    // Past the deadline this call only waits for the watchdog to end the job:
    // leave it MPI and the core, which its report's messages need (a tight
    // MPI_Test loop kept a rank's watchdog from answering rank 0 for 10 s).
    if (context.alarmed) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    } else {
      pauses.After(i);
    }
  }
}

// Complete one of `n` requests, as WaitRequest does one: MPI_Waitany, or
// under the collective timeout MPI_Testany polled. *index says which.
int WaitAnyRequest(int n, MPI_Request* requests, int* index, size_t bytes) {
  CallContext& context = CurrentCall();
  if (context.deadline_ns == 0) {
    MpiGuard guard;
    return MPI_Waitany(n, requests, index, MPI_STATUS_IGNORE);
  }
  Pauses pauses(bytes);
  for (uint32_t i = 1;; ++i) {
    int done = 0, rc = MPI_SUCCESS;
    {
      MpiGuard guard;
      rc = MPI_Testany(n, requests, index, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS || done) return rc;
    if (i % 64 == 0) CheckDeadline(context);
    if (context.alarmed) {
      std::this_thread::sleep_for(std::chrono::microseconds(500));
    } else {
      pauses.After(i);
    }
  }
}

}  // namespace mpi4jax_dist
