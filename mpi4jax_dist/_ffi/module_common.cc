// What the two Python modules (_cpu, _cuda) define alike (module_common.h),
// compiled into each: bindings only, over the core's one registry, record,
// timeout and counts.

#include "module_common.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "agreement.h"
#include "comm_registry.h"
#include "mpi_base.h"
#include "record.h"
#include "stats.h"
#include "timeline.h"
#include "timeout.h"

namespace mpi4jax_dist {

// A dict of counts, for a module's stats().
nb::dict StatsDict(const std::vector<StatsItems>& groups) {
  nb::dict dict;
  for (const StatsItems& items : groups) {
    for (const auto& [name, value] : items) dict[name] = value;
  }
  return dict;
}

void DefineCommon(nb::module_& m) {
  m.def(
      "library_version",
      [] {
        // Callable before MPI_Init: the library this module calls at run time.
        char text[MPI_MAX_LIBRARY_VERSION_STRING];
        int length = 0;
        if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) {
          throw std::runtime_error("MPI_Get_library_version failed");
        }
        return nb::bytes(text, length).attr("decode")("utf-8", "replace");
      },
      "Return MPI_Get_library_version() of the MPI this module calls.");
  m.def(
      "register_comm",
      [](int64_t handle) {
        int64_t id = 0;
        ffi::Error error = CheckMpiUsable("mpi4jax_dist");
        if (error.success()) {
          // Under MPI_THREAD_SERIALIZED this waits for the MPI lock
          // (MpiGuard), which a running program's allreduce may hold.
          nb::gil_scoped_release release;
          error = CommRegistry::Get().Register(handle, &id);
        }
        if (error.failure()) throw std::runtime_error(error.message());
        return id;
      },
      nb::arg("fortran_handle"),
      "Return the communicator's id for compiled calls (CommRegistry in "
      "comm_registry.h), registering it first. MPI must be initialized.");
  m.def(
      "call_counts", [] { return CommRegistry::Get().CallCounts(); },
      "Return the calls entered on each registered communicator, by id.");
  m.def(
      "set_collective_timeout",
      [](double seconds, bool watchdog, bool stacks_on_signal) {
        TimeoutSettings& settings = GetTimeoutSettings();
        settings.timeout_ns =
            seconds > 0 ? static_cast<int64_t>(seconds * 1e9) : 0;
        settings.watchdog = watchdog;
        settings.stacks_on_signal = stacks_on_signal;
      },
      nb::arg("seconds"), nb::arg("watchdog"), nb::arg("stacks_on_signal"),
      "Poll every wait against a deadline of `seconds` (0: off; "
      "TimeoutSettings "
      "in timeout.h).");
  m.def(
      "alarm",
      []() -> nb::object {
        Alarm& alarm = GetAlarm();
        std::lock_guard<std::mutex> lock(alarm.mu);
        if (!alarm.raised) return nb::none();
        return nb::make_tuple(alarm.who, alarm.comm_id, alarm.call,
                              alarm.waited_s);
      },
      "Return (who, comm id, call, seconds waited) of this process's first "
      "timed-out call, or None.");
  m.def(
      "register_site",
      [](const std::string& text, const std::string& compared) {
        return Record::Get().RegisterSite(text, compared);
      },
      nb::arg("text"), nb::arg("compared"),
      "Return the id that compiled calls carry for the place `text` in the "
      "user's code, whose calls the ranks compare by `compared` (its line's "
      "text, or the name given as site=); past 4096 places, the key of "
      "`compared` negated (Record::RegisterSite).");
  m.def(
      "in_flight",
      [] {
        char text[2048];
        Record::Get().InFlightText(text, sizeof text);
        return std::string(text);
      },
      "Return the calls this process is in (entered, not yet returned), "
      "'allreduce #5 SUM float32[4] at step.py:12 in body', several joined by "
      "'; ' ('' when none).");
  m.def(
      "in_flight_reader",
      [] {
        return nb::capsule(reinterpret_cast<void*>(&mpi4jax_dist_in_flight),
                           "mpi4jax_dist.in_flight");
      },
      "Return a capsule of the C function size_t(char* out, size_t capacity) "
      "that writes in_flight()'s text without Python, for _stacks's thread.");
  m.def(
      "timeline_hooks",
      [] {
        return nb::make_tuple(
            reinterpret_cast<uintptr_t>(&mpi4jax_dist_timeline_on),
            reinterpret_cast<uintptr_t>(&mpi4jax_dist_timeline_add_mpi));
      },
      "Return the addresses of the core's mpi4jax_dist_timeline_on and "
      "mpi4jax_dist_timeline_add_mpi, for the MPI wrapper (xla_mpi.time_calls).");
  m.def(
      "timeline_xla",
      [] {
        XlaTimelineNames names = XlaNames();
        return nb::make_tuple(kFirstXlaKind, names.kinds, names.comm_sizes);
      },
      "Return (first kind, kinds' names, communicators' sizes) of XLA's calls "
      "on the timeline so far (timeline.h's XlaNames).");
  m.def(
      "totals_reader",
      [] {
        return nb::capsule(reinterpret_cast<void*>(&mpi4jax_dist_totals),
                           "mpi4jax_dist.totals");
      },
      "Return a capsule of the C function void(int64_t out[3]) that reads the "
      "calls entered, the ns blocked in them and the first's entry, for "
      "_stacks's status lines.");
  m.def(
      "record_events",
      [] {
        const Record& record = Record::Get();
        const int64_t last = record.LastEventNs();
        return nb::make_tuple(
            record.Events(), last ? (SteadyNs() - last) * 1e-9 : -1.0);
      },
      "Return (the calls entered, waited for and ended so far, seconds since "
      "the last of them; -1 before any): the record's progress.");
  m.def(
      "calls",
      [] {
        nb::list calls;
        for (const Record::Copy& e : Record::Get().Entries()) {
          if (e.state != kEntered && e.state != kPosted) continue;
          const CommRegistry::Description comm =
              CommRegistry::Get().Describe(e.comm_id);
          calls.append(nb::make_tuple(
              comm.key, comm.name, comm.size, e.seq, KindName(e.kind),
              OpName(e.op), TypeName(e.type), e.count,
              Record::Get().Site(e.site), e.state == kEntered));
        }
        return calls;
      },
      "Return the calls this process is in, oldest first, as (communicator "
      "key, communicator's name, its size, number there, kind, op, dtype, "
      "count, site, waiting): the key is alike on every member (0 before the "
      "communicator's first call has made its duplicates); waiting is False "
      "for a non-blocking start whose wait is not yet entered.");
  m.def(
      "timeline_start",
      [](int fd, int64_t capacity) { Timeline::Get().Start(fd, capacity); },
      nb::arg("fd"), nb::arg("capacity"),
      "Time every call the record finishes from now on: `capacity` events "
      "held at a time, written to the open descriptor `fd` whenever they "
      "fill it (Timeline in timeline.h).");
  m.def(
      "timeline_stop",
      [] {
        const Timeline::Totals totals = Timeline::Get().Stop();
        return nb::make_tuple(totals.written, totals.lost, totals.error);
      },
      "Stop timing and write the events held; return (events written since "
      "the start, events lost to a failed write, that write's errno or 0).");
  m.def(
      "sites",
      [] {
        const Record& record = Record::Get();
        std::vector<std::string> texts;
        for (int64_t id = 1; id <= record.SiteCount(); ++id) {
          texts.emplace_back(record.Site(id));
        }
        return texts;
      },
      "Return the texts of the registered call sites, site id 1 first.");
  m.def(
      "describe_comm",
      [](int64_t id) {
        const CommRegistry::Description comm = CommRegistry::Get().Describe(id);
        return nb::make_tuple(comm.key, comm.name, comm.size);
      },
      nb::arg("id"),
      "Return (key, name, size) of a registered communicator by id: the key "
      "is alike on every member once its first call has run.");
  m.def(
      "disagreement",
      []() -> nb::object {
        Disagreement& last = LastDisagreement();
        std::lock_guard<std::mutex> lock(last.mu);
        if (!last.seen) return nb::none();
        return nb::make_tuple(last.reporter, last.text);
      },
      "Return (whether this rank reports it, the report) of the last call "
      "the ranks disagreed on, or None.");
  m.attr("HEADER_MPI") = HeaderMpiLibrary();
  m.attr("MPI_STANDARD") = nb::make_tuple(MPI_VERSION, MPI_SUBVERSION);
  m.attr("LARGE_COUNT") = static_cast<bool>(MPI4JAX_DIST_LARGE_COUNT);
  // Whether the blocking allreduce calls MPI_Allreduce_c (mpi_base.h).
  m.attr("ALLREDUCE_LARGE_COUNT") = static_cast<bool>(MPI4JAX_DIST_ALLREDUCE_C);
}

}  // namespace mpi4jax_dist
