// MPI helpers shared by the platform handlers of mpi4jax_dist: cpu.cc, and
// cuda.cc, which reduces device memory in place (CUDA-aware MPI) or stages it
// through a bounded pinned host chunk, one AllreduceChunk call per chunk. The
// non-blocking allreduce (mpi4jax_dist.iallreduce: start, test, wait) keeps its
// requests in flight in the RequestTable at the end; cpu.cc has its handlers.
//
// Everything here is header-only so that each platform source builds alone.

#ifndef MPI4JAX_DIST_FFI_MPI_HELPERS_H_
#define MPI4JAX_DIST_FFI_MPI_HELPERS_H_

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

// MPI-4 brought the large-count ("_c") functions: MPICH >= 4 has them, Open MPI
// 5.0 (whose headers say MPI 3.1) does not. Without them a call takes at most
// INT_MAX elements, and larger messages go in chunks.
#if defined(MPI_VERSION) && MPI_VERSION >= 4
#define MPI4JAX_DIST_LARGE_COUNT 1
#else
#define MPI4JAX_DIST_LARGE_COUNT 0
#endif

// Intel MPI 2021.18.1's MPI_Allreduce_c returns MPI_SUCCESS without reducing a
// count above INT_MAX (seen with mpi4py alone: 2**31 + 16 int8, in place or
// not; its MPI_Iallreduce_c is right): the blocking allreduce goes in chunks of
// at most INT_MAX elements there.
#if MPI4JAX_DIST_LARGE_COUNT && !defined(I_MPI_VERSION)
#define MPI4JAX_DIST_ALLREDUCE_C 1
#else
#define MPI4JAX_DIST_ALLREDUCE_C 0
#endif

namespace mpi4jax_dist {

namespace ffi = xla::ffi;

// What the handlers did, for the tests: a count of what ran, not of what was
// asked for. Relaxed atomics: handlers run on XLA's worker threads.
struct Stats {
  std::atomic<int64_t> handler_calls{0};
  // Handler calls where XLA gave one buffer for operand and result (in place).
  std::atomic<int64_t> same_buffer_calls{0};
  // MPI reduction calls made, and of those the large-count (MPI_Allreduce_c) ones.
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

// ---------------------------------------------------------------------------
// The thread level. XLA runs the handlers on its worker threads, and Python
// calls in here (register_comm, complete_pending) while a program may be
// running. Under MPI_THREAD_MULTIPLE any thread may call MPI at any time. Under
// MPI_THREAD_SERIALIZED (Cray MPICH's default where MPICH_MAX_THREAD_SAFETY is
// unset) any thread may call MPI, one at a time: every MPI call of this
// extension is then made holding one process-wide lock (MpiGuard), a blocking
// one included. Our ops are ordered by one token, so the lock is uncontended
// but for Python's calls beside a running program. The user's own mpi4py
// calls do not take it: they must not overlap a running jitted program (as
// with mpi4jax). Below SERIALIZED the Python side refuses before any call.
//
// The level is read once, at the first guarded call: every caller has checked
// that MPI is initialized (CheckMpiUsable), and MPI_Query_thread may be called
// from any thread then.
inline bool MpiSerialized() {
  static const bool serialized = [] {
    int provided = MPI_THREAD_MULTIPLE;
    return MPI_Query_thread(&provided) == MPI_SUCCESS &&
           provided < MPI_THREAD_MULTIPLE;
  }();
  return serialized;
}

// Holds the MPI lock for its scope where MPI is serialized; nothing otherwise.
// Lock order: a table's own mutex (RequestTable, CommRegistry) may be held when
// this is taken, never the other way round.
class MpiGuard {
 public:
  MpiGuard() : lock_(Mutex(), std::defer_lock) {
    if (MpiSerialized()) {
      lock_.lock();
      GetStats().locked_sections.fetch_add(1, std::memory_order_relaxed);
    }
  }

 private:
  // Never destroyed: MPI may be called from atexit handlers.
  static std::mutex& Mutex() {
    static std::mutex* mutex = new std::mutex();
    return *mutex;
  }
  std::unique_lock<std::mutex> lock_;
};

// Nanoseconds on the steady clock: the collective timeout's deadlines, the
// simulated latency and the wait's counts of time.
inline int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---------------------------------------------------------------------------
// The collective timeout (MPI4JAX_DIST_COLLECTIVE_TIMEOUT; Python sets it with
// set_collective_timeout, mpi4jax_dist/_hangs.py). Off (0), the calls block
// in MPI as before. On, every wait of ours (the allreduce and its agreement
// check, the non-blocking wait) is a non-blocking MPI call polled with
// MPI_Test against a deadline. Past it the call raises the process's alarm
// (the first one wins) and goes on polling: Python's watchdog thread reads
// the alarm, has every rank dump its stacks, names the ranks that had not
// entered the call and ends the job. Where no watchdog runs (below
// MPI_THREAD_MULTIPLE no second thread may call MPI), or it has not ended the
// job kAlarmGraceS after the alarm, the call prints its own line and calls
// MPI_Abort: a timed-out call never returns, since MPI may still write into
// XLA's buffer.
struct TimeoutSettings {
  std::atomic<int64_t> timeout_ns{0};
  std::atomic<bool> watchdog{false};
  // SIGUSR1 dumps this process's stacks (Python's faulthandler is registered).
  std::atomic<bool> stacks_on_signal{false};
};

inline TimeoutSettings& GetTimeoutSettings() {
  static TimeoutSettings settings;
  return settings;
}

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

inline CallContext& CurrentCall() {
  thread_local CallContext context;
  return context;
}

// Start the deadline of the call this thread enters now.
inline void EnterCall(const char* who, int64_t comm_id, int64_t call) {
  CallContext& context = CurrentCall();
  const int64_t timeout = GetTimeoutSettings().timeout_ns.load();
  context.who = who;
  context.comm_id = comm_id;
  context.call = call;
  context.deadline_ns = timeout > 0 ? SteadyNs() + timeout : 0;
  context.alarmed = false;
}

// The first timed-out call of this process, for the watchdog.
struct Alarm {
  std::mutex mu;
  bool raised = false;
  std::string who;
  int64_t comm_id = 0;
  int64_t call = 0;
  double waited_s = 0;
};

inline Alarm& GetAlarm() {
  static Alarm* alarm = new Alarm();  // never destroyed, as the MPI lock
  return *alarm;
}

inline int WorldRank() {
  int rank = -1;
  MpiGuard guard;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

// No watchdog, or none that ended the job in time: say so and end the job.
[[noreturn]] inline void AbortTimedOut(const CallContext& context,
                                       const char* why) {
  const double timeout_s =
      GetTimeoutSettings().timeout_ns.load() / 1e9;
  if (GetTimeoutSettings().stacks_on_signal.load()) {
    // Python's faulthandler prints this process's stacks (mpi4jax_dist/_hangs.py);
    // its reader thread needs a moment.
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
inline void CheckDeadline(CallContext& context) {
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
      alarm.waited_s = (now - context.deadline_ns) / 1e9 +
                       settings.timeout_ns.load() / 1e9;
    }
    return;
  }
  if (now > context.deadline_ns + kAlarmGraceS * 1000000000LL) {
    AbortTimedOut(context, "the watchdog did not end the job in time");
  }
}

// Complete `request`: MPI_Wait without a timeout; with one, MPI_Test polled
// (each test under the MPI lock where MPI is serialized) and the deadline
// checked every 64 tests.
inline int WaitRequest(MPI_Request* request) {
  CallContext& context = CurrentCall();
  if (context.deadline_ns == 0) {
    MpiGuard guard;
    return MPI_Wait(request, MPI_STATUS_IGNORE);
  }
  for (uint32_t i = 1;; ++i) {
    int done = 0, rc = MPI_SUCCESS;
    {
      MpiGuard guard;
      rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS || done) return rc;
    if (i % 64 == 0) CheckDeadline(context);
  }
}

// Count a handler call, and whether XLA gave it one buffer (in place).
inline void CountHandlerCall(const void* operand, const void* result) {
  Stats& stats = GetStats();
  stats.handler_calls.fetch_add(1, std::memory_order_relaxed);
  if (operand == result) {
    stats.same_buffer_calls.fetch_add(1, std::memory_order_relaxed);
  }
}

// Reduction ops, numbered as mpi4jax_dist/_allreduce.py numbers them (_OPS).
inline bool OpFromCode(int32_t code, MPI_Op* op) {
  static const MPI_Op kOps[] = {MPI_SUM,  MPI_PROD, MPI_MIN,  MPI_MAX,
                                MPI_LAND, MPI_LOR,  MPI_LXOR, MPI_BAND,
                                MPI_BOR,  MPI_BXOR};
  if (code < 0 || code >= static_cast<int32_t>(sizeof(kOps) / sizeof(kOps[0])))
    return false;
  *op = kOps[code];
  return true;
}

// The MPI datatype of an XLA element type; false for the ones MPI cannot reduce
// (the Python side refuses those before any MPI call, this is the backstop).
inline bool DatatypeOf(ffi::DataType dtype, MPI_Datatype* out) {
  switch (dtype) {
    case ffi::DataType::PRED:
      *out = MPI_C_BOOL;
      return true;
    case ffi::DataType::S8:
      *out = MPI_INT8_T;
      return true;
    case ffi::DataType::S16:
      *out = MPI_INT16_T;
      return true;
    case ffi::DataType::S32:
      *out = MPI_INT32_T;
      return true;
    case ffi::DataType::S64:
      *out = MPI_INT64_T;
      return true;
    case ffi::DataType::U8:
      *out = MPI_UINT8_T;
      return true;
    case ffi::DataType::U16:
      *out = MPI_UINT16_T;
      return true;
    case ffi::DataType::U32:
      *out = MPI_UINT32_T;
      return true;
    case ffi::DataType::U64:
      *out = MPI_UINT64_T;
      return true;
    case ffi::DataType::F32:
      *out = MPI_FLOAT;
      return true;
    case ffi::DataType::F64:
      *out = MPI_DOUBLE;
      return true;
    case ffi::DataType::C64:
      *out = MPI_C_FLOAT_COMPLEX;
      return true;
    case ffi::DataType::C128:
      *out = MPI_C_DOUBLE_COMPLEX;
      return true;
    default:
      return false;
  }
}

// The function a message is about, by default the blocking allreduce.
constexpr const char* kAllreduceName = "mpi4jax_dist.allreduce";

// "MPI_Allreduce failed: <MPI's own words>" for an MPI error code.
inline ffi::Error MpiError(const char* what, int code,
                           const char* who = kAllreduceName) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = 0;
  }
  return ffi::Error::Internal(std::string(who) + ": " + what +
                              " failed with MPI error " + std::to_string(code) +
                              ": " + std::string(text, length));
}

// MPI must be up (and not yet finalized) before a handler may call it: a
// clear error instead of MPI's abort.
inline ffi::Error CheckMpiUsable(const char* who = kAllreduceName) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(who) + ": MPI is " +
            (finalized ? "already finalized" : "not initialized") +
            "; import mpi4py.MPI before the call and keep MPI up until the "
            "last one has run.");
  }
  return ffi::Error::Success();
}

// One MPI allreduce of `count` elements in place (sendbuf MPI_IN_PLACE).
inline int AllreduceOnce(void* data, size_t count, MPI_Datatype dtype,
                         MPI_Op op, MPI_Comm comm) {
  Stats& stats = GetStats();
  stats.mpi_calls.fetch_add(1, std::memory_order_relaxed);
  int64_t seen = stats.max_call_count.load(std::memory_order_relaxed);
  while (static_cast<int64_t>(count) > seen &&
         !stats.max_call_count.compare_exchange_weak(
             seen, static_cast<int64_t>(count), std::memory_order_relaxed)) {
  }
  if (CurrentCall().deadline_ns != 0) {  // the collective timeout: polled
    MPI_Request request = MPI_REQUEST_NULL;
    int rc = MPI_SUCCESS;
    {
      MpiGuard guard;
#if MPI4JAX_DIST_ALLREDUCE_C
      if (count > static_cast<size_t>(INT_MAX)) {
        stats.large_count_calls.fetch_add(1, std::memory_order_relaxed);
        rc = MPI_Iallreduce_c(MPI_IN_PLACE, data,
                              static_cast<MPI_Count>(count), dtype, op, comm,
                              &request);
      } else
#endif
        rc = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype,
                            op, comm, &request);
    }
    return rc == MPI_SUCCESS ? WaitRequest(&request) : rc;
  }
  MpiGuard guard;
#if MPI4JAX_DIST_ALLREDUCE_C
  if (count > static_cast<size_t>(INT_MAX)) {
    stats.large_count_calls.fetch_add(1, std::memory_order_relaxed);
    return MPI_Allreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                           dtype, op, comm);
  }
#endif
  return MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype, op,
                       comm);
}

// The largest number of elements one MPI call may take: `chunk_bytes` worth
// (0: no limit), and at most INT_MAX where the MPI has no large-count calls.
inline size_t ElementsPerCall(int64_t chunk_bytes, size_t element_bytes) {
  size_t limit = SIZE_MAX;
  if (chunk_bytes > 0) {
    limit = std::max<size_t>(1, static_cast<size_t>(chunk_bytes) /
                                    std::max<size_t>(1, element_bytes));
  }
#if !MPI4JAX_DIST_ALLREDUCE_C
  limit = std::min(limit, static_cast<size_t>(INT_MAX));
#endif
  return limit;
}

// One MPI reduction of `n` elements in place, its failure as an ffi::Error.
inline ffi::Error AllreduceChunk(void* data, size_t n, MPI_Datatype dtype,
                                 MPI_Op op, MPI_Comm comm) {
  const int rc = AllreduceOnce(data, n, dtype, op, comm);
  if (rc != MPI_SUCCESS) {
    return MpiError(MPI4JAX_DIST_ALLREDUCE_C && n > INT_MAX ? "MPI_Allreduce_c"
                                                           : "MPI_Allreduce",
                    rc);
  }
  return ffi::Error::Success();
}

// Allreduce `count` elements of host memory from `in` into `out`, chunk by
// chunk so that MPI's scratch memory is bounded by one chunk.
//
// The MPI standard asks for MPI_IN_PLACE on all ranks or none; every rank
// passes it here. When XLA gives two buffers, each chunk is first copied to
// the result and then reduced in place there.
inline ffi::Error AllreduceChunked(const void* in, void* out, size_t count,
                                   size_t element_bytes, MPI_Datatype dtype,
                                   MPI_Op op, MPI_Comm comm,
                                   int64_t chunk_bytes) {
  const size_t per_call = ElementsPerCall(chunk_bytes, element_bytes);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(per_call, count - done);
    const size_t offset = done * element_bytes;
    if (src != dst) {
      std::memcpy(dst + offset, src + offset, n * element_bytes);
    }
    if (ffi::Error error = AllreduceChunk(dst + offset, n, dtype, op, comm);
        error.failure()) {
      return error;
    }
    done += n;
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Communicators, as compiled code names them. A Fortran handle (py2f) is no
// name to compile in: once the communicator is freed, MPI gives its number to
// the next one made (MPICH did, with the same MPI_Comm value, so MPI_Comm_f2c
// cannot tell). Python registers each communicator here before it lowers a
// call (register_comm); the compiled call carries the registration's id, and
// MPI's attribute delete callback marks it freed when the communicator goes.
// A call on a freed one fails, naming why.
//
// The first call on each registered communicator also checks, with one
// allreduce of 8 integers, that the ranks agree on the call (CheckAgreement):
// ranks that disagree on the count hang once the message goes in chunks.

class CommRegistry {
 public:
  struct Entry {
    MPI_Comm comm = MPI_COMM_NULL;
    std::atomic<bool> freed{false};
    // Whether a call on it has checked the ranks' agreement already.
    std::atomic<bool> checked{false};
    // The calls entered on it in this process (allreduce, iallreduce's
    // start), for the collective timeout's report.
    std::atomic<int64_t> calls{0};
  };

  // Never destroyed: MPI may call the delete callback at MPI_Finalize, from
  // an atexit handler, after static destructors could have run.
  static CommRegistry& Get() {
    static CommRegistry* registry = new CommRegistry();
    return *registry;
  }

  // The id of the communicator of Fortran handle `handle`, registering it
  // first if it is new. MPI must be usable (CheckMpiUsable).
  ffi::Error Register(int64_t handle, int64_t* id,
                      const char* who = kAllreduceName) {
    std::lock_guard<std::mutex> lock(mu_);
    MpiGuard guard;  // after mu_: see MpiGuard's lock order
    MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(handle));
    if (comm == MPI_COMM_NULL) {
      return ffi::Error::InvalidArgument(std::string(who) +
                                         ": the communicator is MPI_COMM_NULL");
    }
    if (keyval_ == MPI_KEYVAL_INVALID) {
      int rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, OnFree, &keyval_,
                                      nullptr);
      if (rc != MPI_SUCCESS) {
        keyval_ = MPI_KEYVAL_INVALID;
        return MpiError("MPI_Comm_create_keyval", rc, who);
      }
    }
    void* value = nullptr;
    int found = 0;
    int rc = MPI_Comm_get_attr(comm, keyval_, &value, &found);
    if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_get_attr", rc, who);
    if (found) {
      *id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
      return ffi::Error::Success();
    }
    entries_.push_back(std::make_unique<Entry>());
    entries_.back()->comm = comm;
    const int64_t new_id = static_cast<int64_t>(entries_.size());
    rc = MPI_Comm_set_attr(comm, keyval_,
                           reinterpret_cast<void*>(static_cast<intptr_t>(new_id)));
    if (rc != MPI_SUCCESS) {
      entries_.pop_back();
      return MpiError("MPI_Comm_set_attr", rc, who);
    }
    *id = new_id;
    return ffi::Error::Success();
  }

  // The live communicator of `id`, and whether this call is the first on it
  // to check the ranks' agreement (see CheckAgreement).
  ffi::Error Find(int64_t id, MPI_Comm* comm, bool* first,
                  const char* who = kAllreduceName) {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < 1 || id > static_cast<int64_t>(entries_.size())) {
      return ffi::Error::InvalidArgument(
          std::string(who) + ": communicator id " + std::to_string(id) +
          " was never registered in this process (was the function compiled "
          "in another process, or by another build of mpi4jax_dist?)");
    }
    Entry& entry = *entries_[id - 1];
    if (entry.freed.load()) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          std::string(who) +
              ": the communicator this function was compiled for has been "
              "freed (comm.Free()) since; MPI may have given its handle to "
              "another communicator. Call the function with a live "
              "communicator (jax.jit traces it again for a new one).");
    }
    *comm = entry.comm;
    *first = !entry.checked.exchange(true);
    return ffi::Error::Success();
  }

  // Count a call entered on `id` (found live by Find); return its number.
  int64_t CountCall(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_[id - 1]->calls.fetch_add(1) + 1;
  }

  // Every registered communicator's count of calls, by id (index id - 1).
  std::vector<int64_t> CallCounts() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> counts;
    for (const auto& entry : entries_) counts.push_back(entry->calls.load());
    return counts;
  }

 private:
  // MPI's attribute delete callback: the communicator is being freed (or MPI
  // finalized, for COMM_WORLD and COMM_SELF).
  static int OnFree(MPI_Comm, int, void* value, void*) {
    CommRegistry& registry = Get();
    std::lock_guard<std::mutex> lock(registry.mu_);
    const int64_t id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
    if (id >= 1 && id <= static_cast<int64_t>(registry.entries_.size())) {
      registry.entries_[id - 1]->freed.store(true);
    }
    return MPI_SUCCESS;
  }

  std::mutex mu_;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// The communicator of compiled id `comm_id`; `*first` tells whether this call
// is the first on it (it then checks the ranks' agreement).
inline ffi::Error CommFromId(int64_t comm_id, MPI_Comm* comm, bool* first,
                             const char* who = kAllreduceName) {
  return CommRegistry::Get().Find(comm_id, comm, first, who);
}

// Whether every rank of a communicator makes a call alike: the same element
// count, element type, op and chunk size. One MPI_Allreduce (MPI_MAX) of each
// value and its negation (AgreementValues): the ranks agree where both maxima
// give the value back (AgreementVerdict). Every rank sees the same maxima, so
// every rank fails alike, and none is left waiting in a chunk the others never
// post. Made on a communicator's first call, and on every call with
// MPI4JAX_DIST_DEBUG_CHECKS=1; blocking in the allreduce (CheckAgreement),
// posted beside the reduction in the non-blocking start and judged in its wait.
constexpr int kAgreementValues = 8;

inline void AgreementValues(size_t count, ffi::DataType dtype, int32_t op_code,
                            int64_t chunk_bytes, int64_t out[kAgreementValues]) {
  const int64_t mine[4] = {static_cast<int64_t>(count),
                           static_cast<int64_t>(dtype), op_code, chunk_bytes};
  for (int i = 0; i < 4; ++i) {
    out[i] = mine[i];
    out[4 + i] = -mine[i];
  }
}

// The error naming what differs between `mine` (AgreementValues) and the
// ranks' maxima `most`; success where nothing does.
inline ffi::Error AgreementVerdict(const int64_t mine[kAgreementValues],
                                   const int64_t most[kAgreementValues],
                                   const char* who) {
  static const char* const kWhat[4] = {"element count", "element type (XLA)",
                                       "op code", "chunk bytes"};
  std::string differ;
  for (int i = 0; i < 4; ++i) {
    if (most[i] != mine[i] || -most[4 + i] != mine[i]) {
      differ += std::string(differ.empty() ? "" : "; ") + kWhat[i] +
                " from " + std::to_string(-most[4 + i]) + " to " +
                std::to_string(most[i]) + " (this rank " +
                std::to_string(mine[i]) + ")";
    }
  }
  if (differ.empty()) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string(who) +
      ": the ranks of the communicator disagree on this call: " + differ +
      ". Every rank must reduce an array of the same shape and dtype with the "
      "same op (and the same MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES); otherwise "
      "MPI hangs, or returns wrong values.");
}

// The blocking check, for the allreduce.
inline ffi::Error CheckAgreement(MPI_Comm comm, size_t count,
                                 ffi::DataType dtype, int32_t op_code,
                                 int64_t chunk_bytes, const char* who) {
  int64_t mine[kAgreementValues], most[kAgreementValues];
  AgreementValues(count, dtype, op_code, chunk_bytes, mine);
  int rc = MPI_SUCCESS;
  if (CurrentCall().deadline_ns != 0) {  // the collective timeout: polled
    MPI_Request request = MPI_REQUEST_NULL;
    {
      MpiGuard guard;
      rc = MPI_Iallreduce(mine, most, kAgreementValues, MPI_INT64_T, MPI_MAX,
                          comm, &request);
    }
    if (rc == MPI_SUCCESS) rc = WaitRequest(&request);
  } else {
    MpiGuard guard;
    rc = MPI_Allreduce(mine, most, kAgreementValues, MPI_INT64_T, MPI_MAX,
                       comm);
  }
  if (rc != MPI_SUCCESS) {
    return MpiError("MPI_Allreduce (agreement check)", rc, who);
  }
  return AgreementVerdict(mine, most, who);
}

// When a call checks the ranks' agreement: on the first call on its
// communicator, or on every call (MPI4JAX_DIST_DEBUG_CHECKS).
enum class Agreement { kFirstCall, kEveryCall };

// The handlers' `check` attribute (MPI4JAX_DIST_DEBUG_CHECKS) as an Agreement.
inline Agreement AgreementFor(int32_t check) {
  return check ? Agreement::kEveryCall : Agreement::kFirstCall;
}

// What every platform's allreduce checks before it touches MPI: operand and
// result of one type and size, a type and an op MPI knows, MPI up, the
// communicator live, and the ranks' agreement when `agreement` says so
// (CheckAgreement, blocking). With `deferred` the caller checks the agreement
// itself (the non-blocking start posts it): *deferred then says whether to.
// Fills in the MPI datatype, op and communicator.
inline ffi::Error CheckAllreduce(const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& y, int64_t comm_id,
                                 int32_t op_code, int64_t chunk_bytes,
                                 Agreement agreement, MPI_Datatype* dtype,
                                 MPI_Op* op, MPI_Comm* comm,
                                 const char* who = kAllreduceName,
                                 bool* deferred = nullptr) {
  if (x.element_type() != y.element_type() ||
      x.element_count() != y.element_count()) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": operand and result differ in type or size");
  }
  if (!DatatypeOf(x.element_type(), dtype)) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": MPI cannot reduce this element type (XLA type " +
        std::to_string(static_cast<int>(x.element_type())) + ")");
  }
  if (!OpFromCode(op_code, op)) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": unknown op code " + std::to_string(op_code));
  }
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  bool first = false;
  if (ffi::Error error = CommFromId(comm_id, comm, &first, who);
      error.failure()) {
    return error;
  }
  EnterCall(who, comm_id, CommRegistry::Get().CountCall(comm_id));
  const bool check = agreement == Agreement::kEveryCall || first;
  if (deferred != nullptr) {
    *deferred = check;
  } else if (check) {
    return CheckAgreement(*comm, x.element_count(), x.element_type(), op_code,
                          chunk_bytes, who);
  }
  return ffi::Error::Success();
}

// A token that exists once `x` does, for the MPI call after an allreduce. With
// it the allreduce returns its array alone: an (array, token) result would be a
// tuple, whose index table (16 bytes) XLA allocates as temp. No work, on any
// platform.
inline ffi::Error TokenAfterImpl(ffi::AnyBuffer, ffi::Result<ffi::Token>) {
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// The non-blocking allreduce (mpi4jax_dist.iallreduce, Request.wait,
// Request.test): a start posts MPI_Iallreduce and returns at once, a
// wait completes it. Between them the request lives in the RequestTable: a
// start takes a slot and hands XLA its handle, an int32 that travels with the
// buffer to the test and wait ops; the wait frees the slot.
//
// MPI reduces into memory the slot owns, never into XLA's buffer: the start
// copies the operand there, the wait copies the result out. XLA may free its
// buffers whenever a run fails between start and wait (the overlapped work
// raising, a check refusing a wait), or never run the wait at all (a request
// kept out of its function), while MPI goes on writing until the request
// completes: at the next MPI call, or in the report at exit. The slot's memory
// stays until then (and forever, for a request that never completes). The
// price is two copies of the message per request, against the microseconds an
// allreduce over a network takes for the few scalars this serves.

constexpr const char* kIallreduceName = "mpi4jax_dist.iallreduce";

// One request in flight.
struct PendingRequest {
  MPI_Request request = MPI_REQUEST_NULL;
  // The ranks' agreement, when this start checks it (see AgreementValues and
  // AdvanceDeferred): MPI_REQUEST_NULL else. `deferred` while the reduction
  // waits for it, with what to post then; `disagreed` once it said no.
  MPI_Request agreement = MPI_REQUEST_NULL;
  int64_t agreement_mine[kAgreementValues] = {};
  int64_t agreement_most[kAgreementValues] = {};
  bool deferred = false;
  bool disagreed = false;
  size_t count = 0;
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  // The memory MPI reduces into, owned here (see above), and the message's
  // size; capacity is what `data` holds, kept between requests when small.
  std::unique_ptr<char[]> data;
  size_t capacity = 0;
  size_t bytes = 0;
  // The start op's id from tracing (0: an eager start, not checked), and where
  // in Python it was made, for the messages.
  int64_t uid = 0;
  std::string site;
  // The communicator's id and the start's number among its calls (see
  // CallContext), for a wait that times out.
  int64_t comm_id = 0;
  int64_t call = 0;
  // When the start posted it (steady clock, ns; see SteadyNs).
  int64_t posted_ns = 0;
  // Simulated latency: the wait holds the result until this time (steady
  // clock, ns; 0: no simulation).
  int64_t ready_ns = 0;
  int32_t generation = 0;
  bool active = false;
};

// What the non-blocking handlers did, for the tests and benchmarks.
struct RequestStats {
  std::atomic<int64_t> starts{0};
  std::atomic<int64_t> large_count_starts{0};
  std::atomic<int64_t> waits{0};
  // Waits whose first MPI_Test completed the reduction (past its simulated
  // latency, if any): nothing was left to wait for. That test progresses the
  // reduction too, so this alone does not say that the MPI moved it on during
  // the overlapped work (wait_blocked_ns, and work without MPI calls, do).
  std::atomic<int64_t> done_before_wait{0};
  // Nanoseconds from the posts to their waits, summed: the work overlapped (and
  // any waiting for other ranks inside it).
  std::atomic<int64_t> wait_slack_ns{0};
  // Nanoseconds the waits spent waiting (MPI_Wait, and the simulated
  // latency's hold) after their first MPI_Test, summed: what the overlapped
  // work did not hide. A wait whose first test completed it adds nothing.
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

// The requests in flight. A handle is generation * kMaxRequests + slot index,
// so that a handle whose slot was freed and taken again (a wait run twice, a
// handle from an earlier run) is refused rather than taken for another request.
// Slots are never moved (unique_ptr), so a handler may use its slot outside the
// lock: data dependencies order the start, tests and wait of one request.
class RequestTable {
 public:
  static constexpr int32_t kMaxRequests = 4096;
  static constexpr int32_t kMaxGeneration = INT32_MAX / kMaxRequests - 1;
  // A completed slot keeps at most this much memory for its next request (a
  // fresh allocation each time costs its page faults: for 64 MiB, as much as
  // the two copies).
  static constexpr size_t kKeepBytes = size_t{64} << 20;

  struct Info {
    int32_t handle;
    int64_t uid;
    std::string site;
  };

  // Never destroyed: a request still pending at exit keeps its memory until
  // the process ends, whatever runs after static destructors.
  static RequestTable& Get() {
    static RequestTable* table = new RequestTable();
    return *table;
  }

  // Take a slot for a start (op `uid`, made at `site`) of `bytes`, copy them
  // from `operand` into the slot's memory, and post its requests with
  // `post(slot)` (an MPI return code) under the table's lock, so that no one
  // finds the slot half made. Refused when that start's previous
  // request is still pending (its wait did not run), or when kMaxRequests
  // are; the slot is freed again when `post` fails.
  template <typename Post>
  ffi::Error Take(int64_t uid, std::string_view site, const void* operand,
                  size_t bytes, int64_t posted_ns, int64_t ready_ns, Post post,
                  int* rc, int32_t* handle) {
    std::lock_guard<std::mutex> lock(mu_);
    PendingRequest* free = nullptr;
    size_t index = 0;
    for (size_t i = 0; i < slots_.size(); ++i) {
      PendingRequest& s = *slots_[i];
      if (s.active && uid != 0 && s.uid == uid) {
        return ffi::Error(
            ffi::ErrorCode::kFailedPrecondition,
            std::string(kIallreduceName) + ": the start made at " +
                std::string(site) +
                " runs again while its previous request is still pending: "
                "its req.wait() did not run (is it in a branch that was "
                "not taken, or was the request kept out of the function?). "
                "Every start needs its wait, on every run.");
      }
      if (!s.active && free == nullptr) {
        free = &s;
        index = i;
      }
    }
    if (free == nullptr) {
      if (slots_.size() >= static_cast<size_t>(kMaxRequests)) {
        return ffi::Error(
            ffi::ErrorCode::kResourceExhausted,
            std::string(kIallreduceName) + ": " +
                std::to_string(kMaxRequests) +
                " requests are pending, none waited on; the start made at " +
                std::string(site) +
                " is refused. Waits are missing: every start needs its "
                "req.wait().");
      }
      slots_.push_back(std::make_unique<PendingRequest>());
      free = slots_.back().get();
      index = slots_.size() - 1;
    }
    if (free->capacity < bytes) {
      // Uninitialized: the copy below fills what MPI reads.
      free->data.reset(new (std::nothrow) char[bytes]);
      free->capacity = free->data ? bytes : 0;
      if (!free->data) {
        return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                          std::string(kIallreduceName) + ": no memory for the " +
                              std::to_string(bytes) +
                              " bytes MPI reduces into (the start made at " +
                              std::string(site) + ")");
      }
    }
    if (bytes > 0) std::memcpy(free->data.get(), operand, bytes);
    free->request = MPI_REQUEST_NULL;
    free->agreement = MPI_REQUEST_NULL;
    free->deferred = free->disagreed = false;
    {
      MpiGuard guard;  // after mu_: see MpiGuard's lock order
      *rc = post(free);
    }
    if (*rc != MPI_SUCCESS) return ffi::Error::Success();  // nothing taken
    free->bytes = bytes;
    free->comm_id = CurrentCall().comm_id;
    free->call = CurrentCall().call;
    free->uid = uid;
    free->posted_ns = posted_ns;
    free->ready_ns = ready_ns;
    free->site.assign(site.data(), site.size());
    free->generation = free->generation % kMaxGeneration + 1;
    free->active = true;
    *handle = free->generation * kMaxRequests + static_cast<int32_t>(index);
    ++active_;
    RequestStats& stats = GetRequestStats();
    int64_t seen = stats.max_pending.load(std::memory_order_relaxed);
    while (active_ > seen && !stats.max_pending.compare_exchange_weak(
                                 seen, active_, std::memory_order_relaxed)) {
    }
    return ffi::Error::Success();
  }

  // The pending request of `handle`, or an error naming what is wrong.
  ffi::Error Find(int32_t handle, const char* who, PendingRequest** slot) {
    std::lock_guard<std::mutex> lock(mu_);
    const int32_t index = handle % kMaxRequests;
    const int32_t generation = handle / kMaxRequests;
    if (handle > 0 && static_cast<size_t>(index) < slots_.size() &&
        slots_[index]->active && slots_[index]->generation == generation) {
      *slot = slots_[index].get();
      return ffi::Error::Success();
    }
    return ffi::Error::InvalidArgument(
        std::string(who) + ": request handle " + std::to_string(handle) +
        " is not pending: it was waited on already, or comes from another run "
        "(a request cannot leave the function that started it).");
  }

  // Free the slot of a completed request (MPI is done with its memory).
  void Free(PendingRequest* slot) {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot->active) --active_;
    slot->active = false;
    slot->request = MPI_REQUEST_NULL;
    slot->agreement = MPI_REQUEST_NULL;
    // Small memory stays for the next start; large goes back.
    if (slot->capacity > kKeepBytes) {
      slot->data.reset();
      slot->capacity = 0;
    }
  }

  std::vector<Info> Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Info> pending;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const PendingRequest& s = *slots_[i];
      if (s.active) {
        pending.push_back(
            {s.generation * kMaxRequests + static_cast<int32_t>(i), s.uid,
             s.site});
      }
    }
    return pending;
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<PendingRequest>> slots_;
  int64_t active_ = 0;
};

// Post one MPI_Iallreduce of `count` elements in place; MPI_Iallreduce_c for
// counts above INT_MAX (the caller refuses those where the MPI has no MPI-4).
inline int PostIallreduce(void* data, size_t count, MPI_Datatype dtype,
                          MPI_Op op, MPI_Comm comm, MPI_Request* request) {
#if MPI4JAX_DIST_LARGE_COUNT
  if (count > static_cast<size_t>(INT_MAX)) {
    GetRequestStats().large_count_starts.fetch_add(1,
                                                   std::memory_order_relaxed);
    return MPI_Iallreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                            dtype, op, comm, request);
  }
#endif
  return MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype, op,
                        comm, request);
}

// The start: copy x into the slot's memory, post MPI_Iallreduce there and set
// *handle to the slot. Host memory. latency_ns > 0 simulates a network with
// that latency: the wait holds the result until latency_ns after this post
// (MPI4JAX_DIST_SIMULATED_LATENCY_US). y, aliased with x, passes on to the
// test and the wait, which write the result into the buffer XLA gives them.
inline ffi::Error IallreduceStart(const ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                                  int64_t comm_id, int32_t op_code,
                                  Agreement agreement, int64_t uid,
                                  std::string_view site, int64_t latency_ns,
                                  int32_t* handle) {
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  // Not a blocking check: a start that only some ranks make would hang in it,
  // where it now fails at exit. The check is posted, and the reduction after
  // it (AdvanceDeferred).
  bool check = false;
  if (ffi::Error error = CheckAllreduce(x, y, comm_id, op_code,
                                        /*chunk_bytes=*/0, agreement, &dtype,
                                        &op, &comm, kIallreduceName, &check);
      error.failure()) {
    return error;
  }
  const size_t count = x.element_count();
  if (!MPI4JAX_DIST_LARGE_COUNT && count > static_cast<size_t>(INT_MAX)) {
    return ffi::Error::InvalidArgument(
        std::string(kIallreduceName) + ": " + std::to_string(count) +
        " elements are more than one MPI_Iallreduce takes (INT_MAX) on an MPI "
        "without MPI-4's MPI_Iallreduce_c, and one request cannot be split "
        "into chunks. Use mpi4jax_dist.allreduce, which reduces in chunks.");
  }
  auto post = [&](PendingRequest* slot) {
    if (check) {
      AgreementValues(count, x.element_type(), op_code, 0,
                      slot->agreement_mine);
      slot->deferred = true;
      slot->count = count;
      slot->dtype = dtype;
      slot->op = op;
      slot->comm = comm;
      return MPI_Iallreduce(slot->agreement_mine, slot->agreement_most,
                            kAgreementValues, MPI_INT64_T, MPI_MAX, comm,
                            &slot->agreement);
    }
    // Nothing to reduce: a null request.
    return count > 0 ? PostIallreduce(slot->data.get(), count, dtype, op, comm,
                                      &slot->request)
                     : MPI_SUCCESS;
  };
  int rc = MPI_SUCCESS;
  const int64_t posted_ns = SteadyNs();
  const int64_t ready_ns = latency_ns > 0 ? posted_ns + latency_ns : 0;
  if (ffi::Error error = RequestTable::Get().Take(
          uid, site, x.untyped_data(), x.size_bytes(), posted_ns, ready_ns,
          post, &rc, handle);
      error.failure()) {
    return error;
  }
  if (rc != MPI_SUCCESS) {
    return MpiError(count > static_cast<size_t>(INT_MAX) ? "MPI_Iallreduce_c"
                                                         : "MPI_Iallreduce",
                    rc, kIallreduceName);
  }
  GetRequestStats().starts.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// A start that checks the ranks' agreement posts the check alone; its
// reduction is posted once the check has completed and agreed, in the first
// test that finds it complete, or in the wait. Posted together, a reduction of
// 1,000 floats on one rank and 2,000 on the other crashed Open MPI 5.0's
// libnbc inside MPI_Test (MPI_ERR_TRUNCATE, then a double free), before the
// wait could judge the check; MPICH reduced it silently. The price: the first
// start on a communicator (every one with MPI4JAX_DIST_DEBUG_CHECKS) hides
// little of its reduction. `block` waits for the check; else one MPI_Test.
// Disagreement is left in slot->disagreed, for the wait to report.
inline ffi::Error AdvanceDeferred(PendingRequest* slot, bool block,
                                  const char* who) {
  if (!slot->deferred) return ffi::Error::Success();
  int done = 1;
  int rc = MPI_SUCCESS;
  if (block) {
    rc = WaitRequest(&slot->agreement);
  } else {
    MpiGuard guard;
    rc = MPI_Test(&slot->agreement, &done, MPI_STATUS_IGNORE);
  }
  if (rc != MPI_SUCCESS) {
    return MpiError(block ? "MPI_Wait (agreement check)"
                          : "MPI_Test (agreement check)",
                    rc, who);
  }
  if (!done) return ffi::Error::Success();
  slot->deferred = false;
  if (AgreementVerdict(slot->agreement_mine, slot->agreement_most, who)
          .failure()) {
    slot->disagreed = true;
    return ffi::Error::Success();
  }
  if (slot->count == 0) return ffi::Error::Success();
  MpiGuard guard;
  const int posted = PostIallreduce(slot->data.get(), slot->count, slot->dtype,
                                    slot->op, slot->comm, &slot->request);
  if (posted != MPI_SUCCESS) {
    return MpiError(slot->count > static_cast<size_t>(INT_MAX)
                        ? "MPI_Iallreduce_c"
                        : "MPI_Iallreduce",
                    posted, who);
  }
  return ffi::Error::Success();
}

// The wait: complete the request of `handle` (MPI_Wait), copy its result into
// y, and free its slot.
inline ffi::Error IallreduceWait(ffi::AnyBuffer& y, int32_t handle) {
  const char* who = "mpi4jax_dist.Request.wait";
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  PendingRequest* slot = nullptr;
  if (ffi::Error error = RequestTable::Get().Find(handle, who, &slot);
      error.failure()) {
    return error;
  }
  // The deadline of a wait starts when it is entered (the start returned at
  // once); the call it names is the start's.
  EnterCall(who, slot->comm_id, slot->call);
  RequestStats& stats = GetRequestStats();
  stats.waits.fetch_add(1, std::memory_order_relaxed);
  const int64_t entered_ns = SteadyNs();
  stats.wait_slack_ns.fetch_add(entered_ns - slot->posted_ns,
                                std::memory_order_relaxed);
  if (ffi::Error error = AdvanceDeferred(slot, /*block=*/true, who);
      error.failure() || slot->disagreed) {
    if (error.success()) {
      error = AgreementVerdict(slot->agreement_mine, slot->agreement_most,
                               kIallreduceName);
    }
    RequestTable::Get().Free(slot);
    return error;
  }
  int done = 0;
  int rc = MPI_SUCCESS;
  {
    MpiGuard guard;
    rc = MPI_Test(&slot->request, &done, MPI_STATUS_IGNORE);
  }
  const int64_t tested_ns = SteadyNs();
  const bool complete = rc == MPI_SUCCESS && done && tested_ns >= slot->ready_ns;
  if (complete) {
    stats.done_before_wait.fetch_add(1, std::memory_order_relaxed);
  }
  if (rc == MPI_SUCCESS && !done) rc = WaitRequest(&slot->request);
  // A simulated latency: the result arrives latency_ns after the post. Spin,
  // as MPI_Wait polls (a sleep overshoots by the timer slack, ~50 us).
  while (slot->ready_ns > 0 && SteadyNs() < slot->ready_ns) {
  }
  if (!complete) {
    stats.wait_blocked_ns.fetch_add(SteadyNs() - tested_ns,
                                    std::memory_order_relaxed);
  }
  if (rc != MPI_SUCCESS) {
    RequestTable::Get().Free(slot);
    return MpiError("MPI_Wait", rc, who);
  }
  if (y.size_bytes() != slot->bytes) {
    const std::string site = slot->site;
    const size_t bytes = slot->bytes;
    RequestTable::Get().Free(slot);
    return ffi::Error::Internal(
        std::string(who) + ": the request started at " + site + " reduced " +
        std::to_string(bytes) + " bytes, but its wait returns " +
        std::to_string(y.size_bytes()));
  }
  if (slot->bytes > 0) {
    std::memcpy(y.untyped_data(), slot->data.get(), slot->bytes);
  }
  RequestTable::Get().Free(slot);
  return ffi::Error::Success();
}

// The test: one MPI_Test on the request of `handle`, so that MPI progresses it
// (the request stays pending for its wait either way).
inline ffi::Error IallreduceTest(int32_t handle) {
  const char* who = "mpi4jax_dist.Request.test";
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  PendingRequest* slot = nullptr;
  if (ffi::Error error = RequestTable::Get().Find(handle, who, &slot);
      error.failure()) {
    return error;
  }
  RequestStats& stats = GetRequestStats();
  stats.tests.fetch_add(1, std::memory_order_relaxed);
  if (ffi::Error error = AdvanceDeferred(slot, /*block=*/false, who);
      error.failure()) {
    return error;
  }
  int done = 0;
  int rc = MPI_SUCCESS;
  {
    MpiGuard guard;
    rc = MPI_Test(&slot->request, &done, MPI_STATUS_IGNORE);
  }
  if (rc != MPI_SUCCESS) return MpiError("MPI_Test", rc, who);
  if (done && !slot->deferred && !slot->disagreed &&
      SteadyNs() >= slot->ready_ns) {
    stats.tests_done.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

// Complete the pending requests of `handles` (all when empty) by polling
// MPI_Test for at most `timeout_s` seconds, and free those completed. For the
// Python side: an eager request dropped without its wait, and the requests
// still pending at exit. Returns the requests left pending (every one when MPI
// is no longer usable: nothing is called then).
inline std::vector<RequestTable::Info> CompletePending(
    const std::vector<int32_t>& handles, double timeout_s) {
  RequestTable& table = RequestTable::Get();
  std::vector<RequestTable::Info> wanted;
  for (const RequestTable::Info& info : table.Pending()) {
    if (handles.empty() ||
        std::find(handles.begin(), handles.end(), info.handle) !=
            handles.end()) {
      wanted.push_back(info);
    }
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return wanted;
  const double deadline = MPI_Wtime() + timeout_s;
  while (!wanted.empty()) {
    std::vector<RequestTable::Info> left;
    for (const RequestTable::Info& info : wanted) {
      PendingRequest* slot = nullptr;
      if (table.Find(info.handle, kIallreduceName, &slot).failure()) continue;
      int done = 0;
      MPI_Request both[2] = {slot->request, slot->agreement};
      int rc = MPI_SUCCESS;
      {
        MpiGuard guard;
        rc = MPI_Testall(2, both, &done, MPI_STATUSES_IGNORE);
      }
      slot->request = both[0];
      slot->agreement = both[1];
      if (rc != MPI_SUCCESS || done) {
        table.Free(slot);  // complete, or failed: MPI has no more use for it
      } else {
        left.push_back(info);
      }
    }
    wanted.swap(left);
    if (wanted.empty() || MPI_Wtime() > deadline) break;
  }
  return wanted;
}

// The version of MPI these headers describe, for the import-time check.
inline std::string HeaderMpiLibrary() {
#if defined(OMPI_MAJOR_VERSION)
  return "Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
         std::to_string(OMPI_MINOR_VERSION) + "." +
         std::to_string(OMPI_RELEASE_VERSION);
#elif defined(I_MPI_VERSION)  // before MPICH: Intel's mpi.h defines both
  return std::string("Intel(R) MPI Library ") + I_MPI_VERSION;
#elif defined(MPICH_VERSION)
  return std::string("MPICH ") + MPICH_VERSION;
#else
  return "MPI " + std::to_string(MPI_VERSION) + "." +
         std::to_string(MPI_SUBVERSION);
#endif
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MPI_HELPERS_H_
