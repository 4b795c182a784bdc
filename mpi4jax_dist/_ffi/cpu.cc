// The CPU handler of mpi4jax_dist.allreduce, and the Python module that hands
// it to JAX (jax.ffi.register_ffi_target).
//
// Built once per MPI family (setup.py names the module _cpu_mpich or
// _cpu_openmpi through MPI4JAX_DIST_MODULE), so that one source tree can serve
// virtual environments with different MPIs.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <string>

#include "mpi_helpers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mpi4jax_dist {
namespace {

// x and a token in, the reduced x out (aliased with x by the lowering). The
// token orders the call after every earlier MPI call of the program: XLA:CPU
// otherwise runs thunks concurrently, ordered only by data. The next call's
// token comes from TokenAfter(y) below.
ffi::Error AllreduceCpuImpl(ffi::AnyBuffer x, ffi::Token,
                            ffi::Result<ffi::AnyBuffer> y, int64_t comm_handle,
                            int32_t op_code, int64_t chunk_bytes) {
  Stats& stats = GetStats();
  stats.handler_calls.fetch_add(1, std::memory_order_relaxed);
  if (x.untyped_data() == y->untyped_data()) {
    stats.same_buffer_calls.fetch_add(1, std::memory_order_relaxed);
  }
  if (x.element_type() != y->element_type() ||
      x.element_count() != y->element_count()) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: operand and result differ in type or size");
  }
  MPI_Datatype dtype;
  if (!DatatypeOf(x.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: MPI cannot reduce this element type (XLA "
        "type " +
        std::to_string(static_cast<int>(x.element_type())) + ")");
  }
  MPI_Op op;
  if (!OpFromCode(op_code, &op)) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: unknown op code " + std::to_string(op_code));
  }
  if (ffi::Error error = CheckMpiUsable(); error.failure()) return error;
  MPI_Comm comm;
  if (ffi::Error error = CommFromHandle(comm_handle, &comm); error.failure())
    return error;
  const size_t count = x.element_count();
  if (count == 0) return ffi::Error::Success();
  return AllreduceChunked(x.untyped_data(), y->untyped_data(), count,
                          x.size_bytes() / count, dtype, op, comm,
                          chunk_bytes);
}

}  // namespace
}  // namespace mpi4jax_dist

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistAllreduceCpu,
                              mpi4jax_dist::AllreduceCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("chunk_bytes"));

// A token that exists once `x` does, for the MPI call after an allreduce. With
// it the allreduce returns its array alone: an (array, token) result would be a
// tuple, whose index table (16 bytes) XLA allocates as temp.
namespace mpi4jax_dist {
namespace {
ffi::Error TokenAfterImpl(ffi::AnyBuffer, ffi::Result<ffi::Token>) {
  return ffi::Error::Success();
}
}  // namespace
}  // namespace mpi4jax_dist

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistTokenAfterCpu,
                              mpi4jax_dist::TokenAfterImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Token>());

// ---------------------------------------------------------------------------
// The Python module: the handler as a capsule, and what the MPI is.

namespace {

PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistAllreduceCpu),
                       nullptr, nullptr);
}

PyObject* TokenHandler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistTokenAfterCpu),
                       nullptr, nullptr);
}

// MPI_Get_library_version of the library this module calls into at run time
// (callable before MPI_Init).
PyObject* LibraryVersion(PyObject*, PyObject*) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) {
    PyErr_SetString(PyExc_RuntimeError, "MPI_Get_library_version failed");
    return nullptr;
  }
  return PyUnicode_DecodeUTF8(text, length, "replace");
}

PyObject* GetStatsDict(PyObject*, PyObject*) {
  const mpi4jax_dist::Stats& s = mpi4jax_dist::GetStats();
  return Py_BuildValue(
      "{s:L,s:L,s:L,s:L,s:L}", "handler_calls",
      static_cast<long long>(s.handler_calls.load()), "same_buffer_calls",
      static_cast<long long>(s.same_buffer_calls.load()), "mpi_calls",
      static_cast<long long>(s.mpi_calls.load()), "large_count_calls",
      static_cast<long long>(s.large_count_calls.load()), "max_call_count",
      static_cast<long long>(s.max_call_count.load()));
}

PyObject* ResetStats(PyObject*, PyObject*) {
  mpi4jax_dist::Stats& s = mpi4jax_dist::GetStats();
  s.handler_calls = 0;
  s.same_buffer_calls = 0;
  s.mpi_calls = 0;
  s.large_count_calls = 0;
  s.max_call_count = 0;
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"allreduce_handler", Handler, METH_NOARGS,
     "Return the XLA FFI handler of the CPU allreduce as a PyCapsule."},
    {"token_after_handler", TokenHandler, METH_NOARGS,
     "Return the XLA FFI handler that makes a token after a buffer."},
    {"library_version", LibraryVersion, METH_NOARGS,
     "Return MPI_Get_library_version() of the MPI this module calls."},
    {"stats", GetStatsDict, METH_NOARGS,
     "Return counts of handler calls and the MPI calls they made."},
    {"reset_stats", ResetStats, METH_NOARGS, "Set every count to zero."},
    {nullptr, nullptr, 0, nullptr},
};

#define MPI4JAX_DIST_STR2(x) #x
#define MPI4JAX_DIST_STR(x) MPI4JAX_DIST_STR2(x)
#define MPI4JAX_DIST_CAT2(a, b) a##b
#define MPI4JAX_DIST_CAT(a, b) MPI4JAX_DIST_CAT2(a, b)

#ifndef MPI4JAX_DIST_MODULE
#error "setup.py defines MPI4JAX_DIST_MODULE, the module's name (_cpu_mpich)"
#endif

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    MPI4JAX_DIST_STR(MPI4JAX_DIST_MODULE),
    "mpi4jax_dist's XLA FFI handlers for the CPU, built against one MPI.",
    -1,
    kMethods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC MPI4JAX_DIST_CAT(PyInit_, MPI4JAX_DIST_MODULE)(void) {
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  const std::string header = mpi4jax_dist::HeaderMpiLibrary();
  if (PyModule_AddStringConstant(module, "HEADER_MPI", header.c_str()) < 0 ||
      PyModule_AddObject(module, "MPI_STANDARD",
                         Py_BuildValue("(ii)", MPI_VERSION, MPI_SUBVERSION)) <
          0 ||
      PyModule_AddObject(module, "LARGE_COUNT",
                         PyBool_FromLong(MPI4JAX_DIST_LARGE_COUNT)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
