// The CPU handlers of mpi4jax_dist.allreduce and of the non-blocking
// mpi4jax_dist.iallreduce (start, test, wait), and the Python module that hands
// them to JAX (jax.ffi.register_ffi_target), built into _cpu (conf/builder.py).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "allreduce.h"
#include "iallreduce.h"
#include "module_helpers.h"
#include "request_table.h"
#include "stats.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mpi4jax_dist {
namespace {

// x and a token in, the reduced x out (aliased with x by the lowering). The
// token orders the call after every earlier MPI call of the program: XLA:CPU
// otherwise runs thunks concurrently, ordered only by data. The next call's
// token comes from TokenAfter(y) below. `comm` is the communicator's id in
// the CommRegistry; `check` 1 checks the ranks' agreement on every call, not
// only on the communicator's first (MPI4JAX_DIST_DEBUG_CHECKS).
ffi::Error AllreduceCpuImpl(ffi::AnyBuffer x, ffi::Token,
                            ffi::Result<ffi::AnyBuffer> y, int64_t comm_id,
                            int32_t op_code, int64_t chunk_bytes,
                            int32_t check) {
  CountHandlerCall(x.untyped_data(), y->untyped_data());
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  if (ffi::Error error =
          CheckAllreduce(x, *y, comm_id, op_code, chunk_bytes,
                         AgreementFor(check), &dtype, &op, &comm);
      error.failure()) {
    return error;
  }
  const size_t count = x.element_count();
  if (count == 0) return ffi::Error::Success();
  return AllreduceChunked(x.untyped_data(), y->untyped_data(), count,
                          x.size_bytes() / count, dtype, op, comm,
                          chunk_bytes);
}

// The non-blocking allreduce (iallreduce.h has the logic). The start: x and a
// token in; x (aliased) and the request's handle out, once MPI_Iallreduce is
// posted. The test and the wait take x and the handle back (x aliased), and
// after them the results of the work placed before them (RemainingArgs): never
// read, they make XLA:CPU's runtime, which orders thunks only by the buffers
// they use, run that work before the test or wait.
ffi::Error IallreduceStartCpuImpl(ffi::AnyBuffer x, ffi::Token,
                                  ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::BufferR0<ffi::S32>> handle,
                                  int64_t comm_id, int32_t op_code,
                                  int32_t check, int64_t uid,
                                  std::string_view site, int64_t latency_ns) {
  return IallreduceStart(x, *y, comm_id, op_code, AgreementFor(check), uid,
                         site, latency_ns, handle->typed_data());
}

ffi::Error IallreduceTestCpuImpl(ffi::AnyBuffer x,
                                 ffi::BufferR0<ffi::S32> handle, ffi::Token,
                                 ffi::RemainingArgs,
                                 ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::BufferR0<ffi::S32>> handle_out) {
  const int32_t h = *handle.typed_data();
  *handle_out->typed_data() = h;
  // Aliased, XLA hands one buffer; were it ever two, pass the values on.
  if (x.untyped_data() != y->untyped_data() && x.size_bytes() > 0) {
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return IallreduceTest(h);
}

ffi::Error IallreduceWaitCpuImpl(ffi::AnyBuffer,
                                 ffi::BufferR0<ffi::S32> handle, ffi::Token,
                                 ffi::RemainingArgs,
                                 ffi::Result<ffi::AnyBuffer> y) {
  return IallreduceWait(*y, *handle.typed_data());
}

// The tie of Request.overlap: the request's handle and arrays in, the
// same arrays out (aliased, in place). No work: the arrays the overlapped work
// reads are then written by a call that comes after the start (or test) that
// wrote the handle, a dependency that XLA keeps through its passes (unlike an
// optimization barrier, which XLA:CPU removes before scheduling) and that its
// runtime, ordering thunks by the buffers they use, honours too.
ffi::Error IallreduceTieCpuImpl(ffi::BufferR0<ffi::S32>, ffi::RemainingArgs args,
                                ffi::RemainingRets rets) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.Request.overlap: the tie has " + std::to_string(args.size()) +
        " arrays in but " + std::to_string(rets.size()) + " out");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> in = args.get<ffi::AnyBuffer>(i);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out =
        rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!out.has_value()) return out.error();
    // Aliased, XLA hands one buffer; were it ever two, pass the values on.
    if (in->untyped_data() != (*out)->untyped_data() && in->size_bytes() > 0) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mpi4jax_dist

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceTieCpu,
                              mpi4jax_dist::IallreduceTieCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceStartCpu,
                              mpi4jax_dist::IallreduceStartCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("check")
                                  .Attr<int64_t>("uid")
                                  .Attr<std::string_view>("site")
                                  .Attr<int64_t>("latency_ns"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceTestCpu,
                              mpi4jax_dist::IallreduceTestCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Token>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceWaitCpu,
                              mpi4jax_dist::IallreduceWaitCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Token>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistAllreduceCpu,
                              mpi4jax_dist::AllreduceCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("chunk_bytes")
                                  .Attr<int32_t>("check"));

// The token after the allreduce: mpi4jax_dist::TokenAfterImpl (allreduce.h).
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

PyObject* IallreduceHandlers(PyObject*, PyObject*) {
  return Py_BuildValue(
      "(NNNN)",
      PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistIallreduceStartCpu),
                    nullptr, nullptr),
      PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistIallreduceTestCpu),
                    nullptr, nullptr),
      PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistIallreduceWaitCpu),
                    nullptr, nullptr),
      PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistIallreduceTieCpu),
                    nullptr, nullptr));
}

// The shared counts, and the non-blocking allreduce's.
PyObject* GetStatsDict(PyObject*, PyObject*) {
  PyObject* dict = mpi4jax_dist::StatsDict();
  if (dict == nullptr) return nullptr;
  const mpi4jax_dist::RequestStats& r = mpi4jax_dist::GetRequestStats();
  const std::pair<const char*, int64_t> counts[] = {
      {"iallreduce_starts", r.starts.load()},
      {"iallreduce_large_count_starts", r.large_count_starts.load()},
      {"iallreduce_waits", r.waits.load()},
      {"iallreduce_done_before_wait", r.done_before_wait.load()},
      {"iallreduce_wait_slack_ns", r.wait_slack_ns.load()},
      {"iallreduce_wait_blocked_ns", r.wait_blocked_ns.load()},
      {"iallreduce_tests", r.tests.load()},
      {"iallreduce_tests_done", r.tests_done.load()},
      {"iallreduce_max_pending", r.max_pending.load()},
  };
  for (const auto& [name, value] : counts) {
    PyObject* number = PyLong_FromLongLong(value);
    if (number == nullptr || PyDict_SetItemString(dict, name, number) < 0) {
      Py_XDECREF(number);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(number);
  }
  return dict;
}

PyObject* ResetStats(PyObject*, PyObject*) {
  mpi4jax_dist::GetStats().Reset();
  mpi4jax_dist::GetRequestStats().Reset();
  Py_RETURN_NONE;
}

PyObject* InfoList(const std::vector<mpi4jax_dist::RequestTable::Info>& infos) {
  PyObject* list = PyList_New(0);
  if (list == nullptr) return nullptr;
  for (const auto& info : infos) {
    PyObject* item = Py_BuildValue("(iLs#)", info.handle,
                                   static_cast<long long>(info.uid),
                                   info.site.data(),
                                   static_cast<Py_ssize_t>(info.site.size()));
    if (item == nullptr || PyList_Append(list, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(list);
      return nullptr;
    }
    Py_DECREF(item);
  }
  return list;
}

PyObject* PendingRequests(PyObject*, PyObject*) {
  return InfoList(mpi4jax_dist::RequestTable::Get().Pending());
}

// complete_pending(handles, timeout_s): see CompletePending (iallreduce.h).
PyObject* CompletePending(PyObject*, PyObject* args) {
  PyObject* sequence = nullptr;
  double timeout_s = 0;
  if (!PyArg_ParseTuple(args, "Od", &sequence, &timeout_s)) return nullptr;
  PyObject* fast = PySequence_Fast(sequence, "handles must be a sequence");
  if (fast == nullptr) return nullptr;
  std::vector<int32_t> handles;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); ++i) {
    const long value = PyLong_AsLong(PySequence_Fast_GET_ITEM(fast, i));
    if (value == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return nullptr;
    }
    handles.push_back(static_cast<int32_t>(value));
  }
  Py_DECREF(fast);
  std::vector<mpi4jax_dist::RequestTable::Info> left;
  Py_BEGIN_ALLOW_THREADS;
  left = mpi4jax_dist::CompletePending(handles, timeout_s);
  Py_END_ALLOW_THREADS;
  return InfoList(left);
}

PyMethodDef kMethods[] = {
    MPI4JAX_DIST_TIMEOUT_METHODS
    {"register_comm", mpi4jax_dist::RegisterComm, METH_VARARGS,
     "register_comm(fortran_handle): the communicator's id for compiled calls "
     "(see CommRegistry in comm_registry.h). MPI must be initialized."},
    {"allreduce_handler", Handler, METH_NOARGS,
     "Return the XLA FFI handler of the CPU allreduce as a PyCapsule."},
    {"token_after_handler", TokenHandler, METH_NOARGS,
     "Return the XLA FFI handler that makes a token after a buffer."},
    {"library_version", mpi4jax_dist::LibraryVersion, METH_NOARGS,
     "Return MPI_Get_library_version() of the MPI this module calls."},
    {"stats", GetStatsDict, METH_NOARGS,
     "Return counts of handler calls and the MPI calls they made."},
    {"reset_stats", ResetStats, METH_NOARGS, "Set every count to zero."},
    {"iallreduce_handlers", IallreduceHandlers, METH_NOARGS,
     "Return the XLA FFI handlers of the non-blocking allreduce's start, test, "
     "wait and overlap's tie as PyCapsules."},
    {"pending_requests", PendingRequests, METH_NOARGS,
     "Return the non-blocking allreduce's requests in flight as (handle, uid, "
     "site) tuples."},
    {"complete_pending", CompletePending, METH_VARARGS,
     "complete_pending(handles, timeout_s): complete the pending requests of "
     "handles (all when empty) by polling MPI_Test for at most timeout_s "
     "seconds; return those left pending as (handle, uid, site)."},
    {nullptr, nullptr, 0, nullptr},
};

#define MPI4JAX_DIST_STR2(x) #x
#define MPI4JAX_DIST_STR(x) MPI4JAX_DIST_STR2(x)
#define MPI4JAX_DIST_CAT2(a, b) a##b
#define MPI4JAX_DIST_CAT(a, b) MPI4JAX_DIST_CAT2(a, b)

#ifndef MPI4JAX_DIST_MODULE
#error "conf/builder.py defines MPI4JAX_DIST_MODULE, the module's name (_cpu)"
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
                         PyBool_FromLong(MPI4JAX_DIST_LARGE_COUNT)) < 0 ||
      // Whether the blocking allreduce calls MPI_Allreduce_c (mpi_base.h).
      PyModule_AddObject(module, "ALLREDUCE_LARGE_COUNT",
                         PyBool_FromLong(MPI4JAX_DIST_ALLREDUCE_C)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
