// The Python side that the platform modules (cpu.cc, cuda.cc) share: what MPI
// they call, and the handler counts. Include after <Python.h>.

#ifndef MPI4JAX_DIST_FFI_MODULE_HELPERS_H_
#define MPI4JAX_DIST_FFI_MODULE_HELPERS_H_

#include "comm_registry.h"
#include "mpi_base.h"
#include "stats.h"
#include "timeout.h"

namespace mpi4jax_dist {

// MPI_Get_library_version of the library this module calls into at run time
// (callable before MPI_Init).
inline PyObject* LibraryVersion(PyObject*, PyObject*) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) {
    PyErr_SetString(PyExc_RuntimeError, "MPI_Get_library_version failed");
    return nullptr;
  }
  return PyUnicode_DecodeUTF8(text, length, "replace");
}

// A new dict of the counts every platform keeps (Stats), for a module's stats().
inline PyObject* StatsDict() {
  const Stats& s = GetStats();
  return Py_BuildValue(
      "{s:L,s:L,s:L,s:L,s:L,s:L}", "handler_calls",
      static_cast<long long>(s.handler_calls.load()), "same_buffer_calls",
      static_cast<long long>(s.same_buffer_calls.load()), "mpi_calls",
      static_cast<long long>(s.mpi_calls.load()), "large_count_calls",
      static_cast<long long>(s.large_count_calls.load()), "max_call_count",
      static_cast<long long>(s.max_call_count.load()), "locked_sections",
      static_cast<long long>(s.locked_sections.load()));
}

// register_comm(fortran_handle) -> id: see CommRegistry (comm_registry.h).
inline PyObject* RegisterComm(PyObject*, PyObject* args) {
  long long handle = 0;
  if (!PyArg_ParseTuple(args, "L", &handle)) return nullptr;
  int64_t id = 0;
  ffi::Error error = CheckMpiUsable("mpi4jax_dist");
  if (error.success()) {
    // Under MPI_THREAD_SERIALIZED this waits for the MPI lock (MpiGuard),
    // which a running program's allreduce may hold: without the GIL.
    Py_BEGIN_ALLOW_THREADS;
    error = CommRegistry::Get().Register(handle, &id);
    Py_END_ALLOW_THREADS;
  }
  if (error.failure()) {
    PyErr_SetString(PyExc_RuntimeError, error.message().c_str());
    return nullptr;
  }
  return PyLong_FromLongLong(id);
}

// set_collective_timeout(seconds, watchdog, stacks_on_signal): see
// TimeoutSettings (timeout.h); 0 seconds turns the timeout off.
inline PyObject* SetCollectiveTimeout(PyObject*, PyObject* args) {
  double seconds = 0;
  int watchdog = 0, stacks = 0;
  if (!PyArg_ParseTuple(args, "dpp", &seconds, &watchdog, &stacks)) {
    return nullptr;
  }
  TimeoutSettings& settings = GetTimeoutSettings();
  settings.timeout_ns = seconds > 0 ? static_cast<int64_t>(seconds * 1e9) : 0;
  settings.watchdog = watchdog != 0;
  settings.stacks_on_signal = stacks != 0;
  Py_RETURN_NONE;
}

// alarm() -> None, or (who, comm id, call number, seconds waited) of the first
// call of this process that timed out.
inline PyObject* AlarmInfo(PyObject*, PyObject*) {
  Alarm& alarm = GetAlarm();
  std::lock_guard<std::mutex> lock(alarm.mu);
  if (!alarm.raised) Py_RETURN_NONE;
  return Py_BuildValue("(sLLd)", alarm.who.c_str(),
                       static_cast<long long>(alarm.comm_id),
                       static_cast<long long>(alarm.call), alarm.waited_s);
}

// call_counts() -> [calls entered on communicator id 1, id 2, ...].
inline PyObject* CallCounts(PyObject*, PyObject*) {
  const std::vector<int64_t> counts = CommRegistry::Get().CallCounts();
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(counts.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < counts.size(); ++i) {
    PyObject* number = PyLong_FromLongLong(counts[i]);
    if (number == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), number);
  }
  return list;
}

#define MPI4JAX_DIST_TIMEOUT_METHODS                                           \
  {"set_collective_timeout", mpi4jax_dist::SetCollectiveTimeout, METH_VARARGS, \
   "set_collective_timeout(seconds, watchdog, stacks_on_signal): poll every "  \
   "wait against a deadline (0: off)."},                                       \
      {"alarm", mpi4jax_dist::AlarmInfo, METH_NOARGS,                          \
       "Return (who, comm id, call, seconds) of the first timed-out call, or " \
       "None."},                                                               \
      {"call_counts", mpi4jax_dist::CallCounts, METH_NOARGS,                   \
       "Return the calls entered on each registered communicator, by id."},

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MODULE_HELPERS_H_
