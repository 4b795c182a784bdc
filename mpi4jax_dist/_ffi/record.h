// The record of the collectives this process runs: a ring of the last
// Record::kEntries calls (their communicator, number there, kind, op, element
// type and count, state, where the user made them), and the table of those
// places. Written by the handlers with plain stores into fixed memory (no
// allocation per call, no lock: the ordered token runs one collective at a
// time; a reader tolerates a torn entry, which only a report reads), and read
// as the calls a rank is in (InFlightText) by Python (in_flight()) and by C
// (_stacks, through in_flight_reader()) for the hang reports: a rank whose
// Python cannot run still says what it is in.

#ifndef MPI4JAX_DIST_FFI_RECORD_H_
#define MPI4JAX_DIST_FFI_RECORD_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "mpi_base.h"

namespace mpi4jax_dist {

// What kind of collective a call is: what the ranks must agree on, beside
// its op, type and count.
enum CallKind : int32_t {
  kBlocking = 1,     // mpi4jax_dist.allreduce
  kNonBlocking = 2,  // mpi4jax_dist.iallreduce (and its wait)
};

// A call's state in the record.
enum CallState : int32_t {
  kEntered = 1,  // waiting in MPI (or about to): what a hung rank stands in
  kDone = 2,
  kFailed = 3,  // returned an error (a disagreement among them)
  kPosted = 4,  // a non-blocking start, posted; its wait not yet entered
};

// A call's kind as the reports name it: "allreduce" or "iallreduce".
MPI4JAX_DIST_CORE_API const char* KindName(int32_t kind);

// The reduction ops by the code the Python side gives them (ops/common.py's
// OPS, op_dtype.h's OpFromCode).
MPI4JAX_DIST_CORE_API const char* OpName(int32_t code);
// OpName's inverse: the code of the op named `name` (-1: none or another).
MPI4JAX_DIST_CORE_API int32_t OpFromName(const char* name);

// An XLA element type as NumPy names it.
MPI4JAX_DIST_CORE_API const char* TypeName(int32_t type);
// TypeName's inverse: the XLA element type NumPy names `name` (0: none).
MPI4JAX_DIST_CORE_API int32_t TypeFromName(const char* name);

// "allreduce #5 SUM float32[4]": a call as the reports name it.
MPI4JAX_DIST_CORE_API std::string CallText(int32_t kind, int64_t seq,
                                           int32_t op, int32_t type,
                                           int64_t count);

class MPI4JAX_DIST_CORE_API Record {
 public:
  static constexpr int kEntries = 256;

  struct Entry {
    std::atomic<int64_t> serial{0};  // 0: never written; else 1, 2, ...
    int64_t comm_id = 0;
    int64_t seq = 0;
    int64_t count = 0;
    int64_t site = 0;
    int64_t entered_ns = 0;
    int64_t waited_ns = 0;  // a non-blocking call's wait entered (Waiting)
    int32_t kind = 0;
    int32_t op = 0;
    int32_t type = 0;
    std::atomic<int32_t> state{0};
    // The communicator as the reports name it ("communicator 'NAME' (P
    // ranks)": comm_registry.h's Entry::name, which lives as long as the
    // process).
    const char* comm_name = "";
  };

  // The process's record, the core's. Never destroyed: reports may read it
  // while the process exits.
  static Record& Get();

  // An entry as its writer holds it: a later call that wraps the ring round
  // takes the entry over, and then Finish leaves it alone.
  struct Handle {
    Entry* entry = nullptr;
    int64_t serial = 0;
  };

  // Write a call entering (`state`: kEntered, or kPosted for a non-blocking
  // start); return its handle, for Finish.
  Handle Enter(int64_t comm_id, int64_t seq, int32_t kind, int32_t op,
               int32_t type, int64_t count, int64_t site, int64_t now_ns,
               const char* comm_name = "", CallState state = kEntered);

  // A call's state changes: done or failed (Finish), or a posted start's wait
  // entered (Waiting). Each is an event of the record (Events). Finish adds
  // the call to the timeline where it is on (timeline.h).
  static void Finish(const Handle& handle, CallState state);
  static void Waiting(const Handle& handle);

  // What the watchdog reads as this process's collectives making progress
  // (mpi4jax_dist/faults/progress.py): the number of calls entered, waited
  // for and ended so far, and when the last of them was (steady clock, ns).
  int64_t Events() const { return events_.load(std::memory_order_relaxed); }
  int64_t LastEventNs() const {
    return last_event_ns_.load(std::memory_order_relaxed);
  }

  // What `python -m mpi4jax_dist status` reads of this process: the calls
  // entered so far, the time spent blocked in them (a blocking call from its
  // entry, a non-blocking one from its wait's, to its end, or to `now_ns` for
  // a call still waited in), and when the first was entered (steady clock,
  // ns; 0 before any). Any thread, no lock.
  struct Totals {
    int64_t entered, blocked_ns, first_ns;
  };
  Totals Sums(int64_t now_ns) const;

  // A place in the user's code ("step.py:12 in body"), registered when a call
  // is lowered; its id goes into the compiled call. `compared` is what the
  // ranks compare of it (the line's text, or the name the call was given:
  // ops/common.py's call_site), kept as its key (SiteKey) beside the text so
  // that a call reads it by id with one load. Past kSites places the id is
  // the key, negated: the call is still compared, its place not named.
  // Allocates, at lowering only.
  int64_t RegisterSite(const std::string& text, const std::string& compared);

  // The text of site `id` ("" for an unknown id or one past kSites): any
  // thread, no lock (a site once published never changes or goes).
  const char* Site(int64_t id) const;

  // How many sites are registered: their ids are 1 to this.
  int64_t SiteCount() const {
    return published_.load(std::memory_order_acquire);
  }

  // The key the ranks compare for site `id` (CallHeader::site_key; 0 for an
  // unknown id): any thread, no lock.
  int64_t Key(int64_t id) const;

  // The key of a site's compared text: FNV-1a (64 bits, no seed, so equal on
  // every rank and in every build for one text), its top bit cleared so that
  // an id past kSites can carry it negated, and never 0.
  static int64_t SiteKey(std::string_view compared);

  // The entries written, oldest first (at most kEntries).
  struct Copy {
    int64_t serial, comm_id, seq, count, site, entered_ns, waited_ns;
    int32_t kind, op, type, state;
    const char* comm_name;
  };
  std::vector<Copy> Entries() const;

  // The calls still entered, as the hang reports group ranks by them:
  // "allreduce #5 SUM float32[4] on communicator 'MPI_COMM_WORLD' (2 ranks)
  // at step.py:12 in body", a posted start whose wait is not yet entered
  // followed by " (started, not waited for)", several joined by "; " (""
  // when none). Written into `out` (at most `capacity` bytes, NUL ended); any
  // thread, no lock, no Python: the _stacks thread reads it for a rank whose
  // Python cannot answer.
  size_t InFlightText(char* out, size_t capacity) const;

 private:
  // The handle's entry, or nullptr where a later call has taken it over.
  static Entry* Live(const Handle& handle);
  // Returns the time it was set (steady clock, ns).
  static int64_t SetState(const Handle& handle, CallState state);
  void Touch(int64_t now_ns);

  Entry entries_[kEntries];
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> events_{0};
  std::atomic<int64_t> last_event_ns_{0};
  std::atomic<int64_t> blocked_ns_{0};
  std::atomic<int64_t> first_ns_{0};
  static constexpr int64_t kSites = 4096;
  std::mutex mu_;
  std::atomic<const std::string*> sites_[kSites] = {};
  int64_t keys_[kSites] = {};  // written before their site is published
  std::atomic<int64_t> published_{0};
};

}  // namespace mpi4jax_dist

// Record::InFlightText of the process's record as a plain C function, which
// _stacks's thread calls (the modules hand it over as in_flight_reader()).
extern "C" MPI4JAX_DIST_CORE_API size_t mpi4jax_dist_in_flight(char* out,
                                                               size_t capacity);

// Record::Sums of the process's record as a plain C function, for the same
// thread's status lines (the modules hand it over as totals_reader()):
// `out` receives entered, blocked_ns and first_ns.
extern "C" MPI4JAX_DIST_CORE_API void mpi4jax_dist_totals(int64_t out[3]);

#endif  // MPI4JAX_DIST_FFI_RECORD_H_
