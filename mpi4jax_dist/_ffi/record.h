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
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "mpi_base.h"
#include "timeout.h"

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

inline const char* KindName(int32_t kind) {
  return kind == kNonBlocking ? "iallreduce" : "allreduce";
}


// The reduction ops by the code the Python side gives them (ops/common.py's
// OPS, op_dtype.h's OpFromCode).
inline const char* OpName(int32_t code) {
  static const char* const kNames[] = {"SUM",  "PROD", "MIN", "MAX",
                                       "LAND", "LOR",  "LXOR", "BAND",
                                       "BOR",  "BXOR"};
  return code >= 0 && code < 10 ? kNames[code] : "?";
}

// An XLA element type as NumPy names it.
inline const char* TypeName(int32_t type) {
  switch (static_cast<ffi::DataType>(type)) {
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::C64:
      return "complex64";
    case ffi::DataType::C128:
      return "complex128";
    default:
      return "?";
  }
}

// "allreduce #5 SUM float32[4]": a call as the reports name it.
inline std::string CallText(int32_t kind, int64_t seq, int32_t op,
                            int32_t type, int64_t count) {
  char text[160];
  std::snprintf(text, sizeof text, "%s #%lld %s %s[%lld]", KindName(kind),
                static_cast<long long>(seq), OpName(op), TypeName(type),
                static_cast<long long>(count));
  return text;
}

class Record {
 public:
  static constexpr int kEntries = 256;

  struct Entry {
    std::atomic<int64_t> serial{0};  // 0: never written; else 1, 2, ...
    int64_t comm_id = 0;
    int64_t seq = 0;
    int64_t count = 0;
    int64_t site = 0;
    int64_t entered_ns = 0;
    int32_t kind = 0;
    int32_t op = 0;
    int32_t type = 0;
    std::atomic<int32_t> state{0};
    // The communicator as the reports name it ("communicator 'NAME' (P
    // ranks)": comm_registry.h's Entry::name, which lives as long as the
    // process).
    const char* comm_name = "";
  };

  // Never destroyed: reports may read it while the process exits.
  static Record& Get() {
    static Record* record = new Record();
    return *record;
  }

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
               const char* comm_name = "", CallState state = kEntered) {
    const int64_t serial = next_.fetch_add(1, std::memory_order_relaxed) + 1;
    Entry& e = entries_[(serial - 1) % kEntries];
    e.serial.store(0, std::memory_order_relaxed);  // torn while written
    e.comm_id = comm_id;
    e.seq = seq;
    e.count = count;
    e.site = site;
    e.entered_ns = now_ns;
    e.kind = kind;
    e.op = op;
    e.type = type;
    e.comm_name = comm_name;
    e.state.store(state, std::memory_order_relaxed);
    e.serial.store(serial, std::memory_order_release);
    Touch(now_ns);
    return {&e, serial};
  }

  // A call's state changes: done or failed (Finish), or a posted start's wait
  // entered (Waiting). Each is an event of the record (Events).
  static void Finish(const Handle& handle, CallState state) {
    SetState(handle, state);
  }
  static void Waiting(const Handle& handle) { SetState(handle, kEntered); }

  // What the watchdog reads as this process's collectives making progress
  // (mpi4jax_dist/faults/progress.py): the number of calls entered, waited
  // for and ended so far, and when the last of them was (steady clock, ns).
  int64_t Events() const { return events_.load(std::memory_order_relaxed); }
  int64_t LastEventNs() const {
    return last_event_ns_.load(std::memory_order_relaxed);
  }

  // A place in the user's code ("step.py:12 in body"), registered when a call
  // is lowered; its id goes into the compiled call. `compared` is what the
  // ranks compare of it (the line's text, or the name the call was given:
  // ops/common.py's call_site), kept as its key (SiteKey) beside the text so
  // that a call reads it by id with one load. Past kSites places the id is
  // the key, negated: the call is still compared, its place not named.
  // Allocates, at lowering only.
  int64_t RegisterSite(const std::string& text, const std::string& compared) {
    const int64_t key = SiteKey(compared);
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t known = published_.load(std::memory_order_relaxed);
    for (int64_t i = 0; i < known; ++i) {
      if (keys_[i] == key && *sites_[i].load(std::memory_order_relaxed) == text)
        return i + 1;
    }
    if (known >= kSites) return -key;
    keys_[known] = key;
    sites_[known].store(new std::string(text), std::memory_order_relaxed);
    published_.store(known + 1, std::memory_order_release);
    return known + 1;
  }

  // The text of site `id` ("" for an unknown id or one past kSites): any
  // thread, no lock (a site once published never changes or goes).
  const char* Site(int64_t id) const {
    if (id < 1 || id > published_.load(std::memory_order_acquire)) return "";
    return sites_[id - 1].load(std::memory_order_relaxed)->c_str();
  }

  // The key the ranks compare for site `id` (CallHeader::site_key; 0 for an
  // unknown id): any thread, no lock.
  int64_t Key(int64_t id) const {
    if (id < 0) return -id;
    if (id < 1 || id > published_.load(std::memory_order_acquire)) return 0;
    return keys_[id - 1];
  }

  // The key of a site's compared text: FNV-1a (64 bits, no seed, so equal on
  // every rank and in every build for one text), its top bit cleared so that
  // an id past kSites can carry it negated, and never 0.
  static int64_t SiteKey(std::string_view compared) {
    uint64_t hash = 14695981039346656037ull;
    for (unsigned char c : compared) {
      hash ^= c;
      hash *= 1099511628211ull;
    }
    const int64_t key = static_cast<int64_t>(hash & INT64_MAX);
    return key != 0 ? key : 1;
  }

  // The entries written, oldest first (at most kEntries).
  struct Copy {
    int64_t serial, comm_id, seq, count, site, entered_ns;
    int32_t kind, op, type, state;
    const char* comm_name;
  };
  std::vector<Copy> Entries() const {
    std::vector<Copy> out;
    const int64_t last = next_.load(std::memory_order_acquire);
    for (int64_t s = std::max<int64_t>(1, last - kEntries + 1); s <= last; ++s) {
      const Entry& e = entries_[(s - 1) % kEntries];
      if (e.serial.load(std::memory_order_acquire) != s) continue;  // torn
      out.push_back({s, e.comm_id, e.seq, e.count, e.site, e.entered_ns,
                     e.kind, e.op, e.type,
                     e.state.load(std::memory_order_acquire), e.comm_name});
    }
    return out;
  }

  // The calls still entered, as the hang reports group ranks by them:
  // "allreduce #5 SUM float32[4] on communicator 'MPI_COMM_WORLD' (2 ranks)
  // at step.py:12 in body", a posted start whose wait is not yet entered
  // followed by " (started, not waited for)", several joined by "; " (""
  // when none). Written into `out` (at most `capacity` bytes, NUL ended); any
  // thread, no lock, no Python: the _stacks thread reads it for a rank whose
  // Python cannot answer.
  size_t InFlightText(char* out, size_t capacity) const {
    if (capacity == 0) return 0;
    size_t used = 0;
    out[0] = '\0';
    for (const Copy& e : Entries()) {
      if (e.state != kEntered && e.state != kPosted) continue;
      const char* site = Site(e.site);
      const int n = std::snprintf(
          out + used, capacity - used, "%s%s%s%s%s%s%s", used ? "; " : "",
          CallText(e.kind, e.seq, e.op, e.type, e.count).c_str(),
          e.comm_name[0] ? " on " : "", e.comm_name, site[0] ? " at " : "",
          site, e.state == kPosted ? " (started, not waited for)" : "");
      if (n < 0) break;
      used = std::min(capacity - 1, used + static_cast<size_t>(n));
    }
    return used;
  }

 private:
  static void SetState(const Handle& handle, CallState state) {
    if (handle.entry != nullptr &&
        handle.entry->serial.load(std::memory_order_acquire) == handle.serial) {
      handle.entry->state.store(state, std::memory_order_release);
    }
    Get().Touch(SteadyNs());
  }

  void Touch(int64_t now_ns) {
    events_.fetch_add(1, std::memory_order_relaxed);
    last_event_ns_.store(now_ns, std::memory_order_relaxed);
  }

  Entry entries_[kEntries];
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> events_{0};
  std::atomic<int64_t> last_event_ns_{0};
  static constexpr int64_t kSites = 4096;
  std::mutex mu_;
  std::atomic<const std::string*> sites_[kSites] = {};
  int64_t keys_[kSites] = {};  // written before their site is published
  std::atomic<int64_t> published_{0};
};

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_RECORD_H_
