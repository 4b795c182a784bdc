// The Python side that the platform modules (cpu.cc, cuda.cc) share: what MPI
// they call, and the handler counts. Include after <Python.h> and mpi_helpers.h.

#ifndef MPI4JAX_DIST_FFI_MODULE_HELPERS_H_
#define MPI4JAX_DIST_FFI_MODULE_HELPERS_H_

#include "mpi_helpers.h"

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

// register_comm(fortran_handle) -> id: see CommRegistry (mpi_helpers.h).
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

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MODULE_HELPERS_H_
