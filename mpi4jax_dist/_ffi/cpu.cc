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
#include "module_helpers.h"
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
  CountHandlerCall(x.untyped_data(), y->untyped_data());
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  if (ffi::Error error =
          CheckAllreduce(x, *y, comm_handle, op_code, &dtype, &op, &comm);
      error.failure()) {
    return error;
  }
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

// The token after the allreduce: mpi4jax_dist::TokenAfterImpl (mpi_helpers.h).
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

PyObject* GetStatsDict(PyObject*, PyObject*) {
  return mpi4jax_dist::StatsDict();
}

PyObject* ResetStats(PyObject*, PyObject*) {
  mpi4jax_dist::GetStats().Reset();
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"allreduce_handler", Handler, METH_NOARGS,
     "Return the XLA FFI handler of the CPU allreduce as a PyCapsule."},
    {"token_after_handler", TokenHandler, METH_NOARGS,
     "Return the XLA FFI handler that makes a token after a buffer."},
    {"library_version", mpi4jax_dist::LibraryVersion, METH_NOARGS,
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
