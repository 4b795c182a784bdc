// The timeline: when each collective of the record entered and left, for
// MPI4JAX_DIST_TIMELINE (mpi4jax_dist/timing/timeline.py). Off by default, and
// then a call pays one relaxed load (Timeline::On). On, each call the record
// finishes appends one TimelineEvent to fixed memory, which goes to the rank's file
// (a descriptor Python opened) whenever it is full and at Stop: no allocation
// per call, one uncontended lock.

#ifndef MPI4JAX_DIST_FFI_TIMELINE_H_
#define MPI4JAX_DIST_FFI_TIMELINE_H_

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "mpi_base.h"

namespace mpi4jax_dist {

// One call, as the rank's file holds it: 64 bytes, in the machine's byte order
// (timeline.py's EVENT dtype reads them). Times on the steady clock
// (CLOCK_MONOTONIC, SteadyNs), in ns.
struct TimelineEvent {
  int64_t enter_ns;  // entered (a non-blocking call: started)
  int64_t wait_ns;   // a non-blocking call's wait entered; else enter_ns
  int64_t leave_ns;  // returned (a non-blocking call: its wait did)
  int64_t comm_id;   // CommRegistry's id, this process's
  int64_t seq;       // the call's number on its communicator
  int64_t count;     // elements
  int64_t site;      // Record's site id (its text: Record::Site)
  int32_t kind;      // CallKind
  uint8_t op;        // OpName's code
  uint8_t type;      // an XLA element type (TypeName)
  uint8_t state;     // CallState: kDone or kFailed
  uint8_t reserved;
};
static_assert(sizeof(TimelineEvent) == 64, "the file's record is 64 bytes");

class MPI4JAX_DIST_CORE_API Timeline {
 public:
  static Timeline& Get();

  // Whether calls are being timed: one relaxed load, what a call pays when off.
  bool On() const { return on_.load(std::memory_order_relaxed); }

  // Time calls from now on, `capacity` events in memory at a time, written to
  // `fd` (open for writing, kept open by the caller until Stop) whenever they
  // fill it. Starting again restarts on the new descriptor, in the memory of
  // the last start where its capacity was the same (kept after Stop).
  void Start(int fd, int64_t capacity);

  // Append one call (from Record::Finish). Writes the events held to the file
  // when they fill the memory, inside this call: that call takes longer, and
  // the timeline shows it.
  void Add(const TimelineEvent& event);

  // Stop timing and write the events still held. Returns the events written
  // in all since Start, and the first write's errno that failed (0: none;
  // the events of a failed write are lost, and counted in `lost`).
  struct Totals {
    int64_t written = 0;
    int64_t lost = 0;
    int error = 0;
  };
  Totals Stop();

 private:
  void FlushLocked();

  std::atomic<bool> on_{false};
  std::mutex mu_;
  std::vector<TimelineEvent> events_;
  size_t used_ = 0;
  int fd_ = -1;
  Totals totals_;
};

// XLA's collectives over MPI on the timeline (MPI4JAX_DIST_CPU_COLLECTIVES=mpi):
// the MPIABI wrapper (mpiabi_record.c) times each at its entry and return and
// hands it to mpi4jax_dist_timeline_add_mpi. Their kinds are numbered from
// kFirstXlaKind, one per MPI function as first met ("MPI_Allreduce"); their
// communicators carry negative ids (-1 - the wrapper's index of it); their site
// is the one text kXlaSite. XlaTimelineNames gives the kinds' names and the
// communicators' sizes for the rank's JSON (timing/timeline.py).
constexpr int32_t kFirstXlaKind = 16;
constexpr const char* kXlaSite = "a program of XLA's";
struct XlaTimelineNames {
  std::vector<std::string> kinds;  // kind kFirstXlaKind + i: kinds[i]
  std::vector<int> comm_sizes;     // communicator -1 - i: comm_sizes[i] ranks
};
MPI4JAX_DIST_CORE_API XlaTimelineNames XlaNames();

}  // namespace mpi4jax_dist

// What the wrapper calls (handed over by xla_mpi.time_calls): whether a
// timeline is being written, and one collective of XLA's (steady clock, ns;
// the MPI function's, op's and type's names as the wrapper's record keeps
// them; NULL op or type for none).
extern "C" MPI4JAX_DIST_CORE_API int mpi4jax_dist_timeline_on(void);
extern "C" MPI4JAX_DIST_CORE_API void mpi4jax_dist_timeline_add_mpi(
    int64_t enter_ns, int64_t leave_ns, int64_t comm_index, int64_t comm_size,
    int64_t seq, int64_t count, const char* call, const char* op,
    const char* type);

#endif  // MPI4JAX_DIST_FFI_TIMELINE_H_
