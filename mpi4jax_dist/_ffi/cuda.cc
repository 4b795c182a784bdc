// The CUDA handler of mpi4jax_dist.allreduce, and the Python module that hands
// it to JAX (jax.ffi.register_ffi_target(..., platform="CUDA")).
//
// Plain C++ over the CUDA runtime API (no kernels): setup.py compiles it with
// the host compiler where CUDA headers exist, into _cuda_mpich or
// _cuda_openmpi beside the CPU module, so that the CPU module never depends on
// CUDA. Two ways to reduce a device buffer, chosen per compiled call by the
// `cuda_aware` attribute (MPI4JAX_DIST_CUDA_AWARE_MPI, see _config.py):
//
// - CUDA-aware MPI: wait for the stream, then MPI reduces the device buffer in
//   place, in chunks as on the CPU. Device memory: the message.
// - Staged (the default): per chunk of at most chunk_bytes, copy device ->
//   pinned host chunk on XLA's stream, wait, reduce the host chunk in place,
//   copy it back. Device memory: the message; host memory: one chunk, in a
//   pinned buffer allocated once (grown when a call needs more) and reused.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "mpi_helpers.h"
#include "module_helpers.h"
#include "xla/ffi/api/ffi.h"

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // MPIX_Query_cuda_support, where Open MPI has it
#endif

namespace ffi = xla::ffi;

namespace mpi4jax_dist {
namespace {

// What the CUDA handler did beyond the shared Stats, for the tests.
struct CudaStats {
  std::atomic<int64_t> cuda_aware_calls{0};
  std::atomic<int64_t> staged_calls{0};
  // Chunks copied to the host and back.
  std::atomic<int64_t> staged_chunks{0};
  // Pinned host bytes allocated now, and the most ever at once.
  std::atomic<int64_t> pinned_bytes{0};
  std::atomic<int64_t> pinned_peak_bytes{0};
};

CudaStats& GetCudaStats() {
  static CudaStats stats;
  return stats;
}

ffi::Error CudaError(const char* what, cudaError_t code) {
  return ffi::Error::Internal(std::string("mpi4jax_dist.allreduce: ") + what +
                              " failed with " + cudaGetErrorName(code) + ": " +
                              cudaGetErrorString(code));
}

#define MPI4JAX_DIST_CUDA_CHECK(call)                            \
  do {                                                           \
    const cudaError_t mpi4jax_dist_rc = (call);                  \
    if (mpi4jax_dist_rc != cudaSuccess)                          \
      return CudaError(#call, mpi4jax_dist_rc);                  \
  } while (0)

// Pinned host buffers for staging, one per call running at once (normally
// one per process). A call takes the largest idle buffer, growing it when it
// is too small, and gives it back when done; buffers live until
// ReleasePinned() (Python calls it at exit).
class PinnedPool {
 public:
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
  };

  // A buffer of at least `bytes`.
  ffi::Error Take(size_t bytes, Buffer* out) {
    Buffer buffer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        auto largest = std::max_element(
            idle_.begin(), idle_.end(),
            [](const Buffer& a, const Buffer& b) { return a.bytes < b.bytes; });
        buffer = *largest;
        idle_.erase(largest);
      }
    }
    if (buffer.bytes >= bytes) {
      *out = buffer;
      return ffi::Error::Success();
    }
    if (buffer.data != nullptr) {
      Free(buffer);
    }
    // Portable: usable whichever device's context the next call runs in.
    MPI4JAX_DIST_CUDA_CHECK(
        cudaHostAlloc(&buffer.data, bytes, cudaHostAllocPortable));
    buffer.bytes = bytes;
    CudaStats& stats = GetCudaStats();
    const int64_t now =
        stats.pinned_bytes.fetch_add(static_cast<int64_t>(bytes)) +
        static_cast<int64_t>(bytes);
    int64_t peak = stats.pinned_peak_bytes.load();
    while (now > peak &&
           !stats.pinned_peak_bytes.compare_exchange_weak(peak, now)) {
    }
    *out = buffer;
    return ffi::Error::Success();
  }

  void Give(const Buffer& buffer) {
    std::lock_guard<std::mutex> lock(mutex_);
    idle_.push_back(buffer);
  }

  // Free every idle buffer; returns the bytes freed.
  size_t Release() {
    std::vector<Buffer> idle;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      idle.swap(idle_);
    }
    size_t freed = 0;
    for (const Buffer& buffer : idle) {
      freed += buffer.bytes;
      Free(buffer);
    }
    return freed;
  }

 private:
  static void Free(const Buffer& buffer) {
    // An error here (the CUDA runtime already shut down at exit) leaves the
    // memory to the operating system, which reclaims it with the process.
    cudaFreeHost(buffer.data);
    GetCudaStats().pinned_bytes.fetch_sub(static_cast<int64_t>(buffer.bytes));
  }

  std::mutex mutex_;
  std::vector<Buffer> idle_;
};

// Never destroyed: at exit the CUDA runtime may be gone before static
// destructors run. Python frees the buffers earlier (atexit -> release_pinned).
PinnedPool& Pool() {
  static PinnedPool* pool = new PinnedPool();
  return *pool;
}

// Makes the buffer's device current on this thread: the runtime API works on
// the current device, and XLA's thread need not have made it current (a
// process may drive several GPUs). A host pointer leaves it as it is.
ffi::Error UseDeviceOf(const void* data) {
  cudaPointerAttributes attributes;
  MPI4JAX_DIST_CUDA_CHECK(cudaPointerGetAttributes(&attributes, data));
  if (attributes.type != cudaMemoryTypeDevice &&
      attributes.type != cudaMemoryTypeManaged) {
    return ffi::Error::Success();
  }
  int current = -1;
  MPI4JAX_DIST_CUDA_CHECK(cudaGetDevice(&current));
  if (current != attributes.device) {
    MPI4JAX_DIST_CUDA_CHECK(cudaSetDevice(attributes.device));
  }
  return ffi::Error::Success();
}

// MPI reads and writes device memory itself.
ffi::Error AllreduceCudaAware(cudaStream_t stream, const char* in, char* out,
                              size_t count, size_t element_bytes,
                              MPI_Datatype dtype, MPI_Op op, MPI_Comm comm,
                              int64_t chunk_bytes) {
  GetCudaStats().cuda_aware_calls.fetch_add(1, std::memory_order_relaxed);
  if (in != out) {
    MPI4JAX_DIST_CUDA_CHECK(cudaMemcpyAsync(
        out, in, count * element_bytes, cudaMemcpyDeviceToDevice, stream));
  }
  // MPI must see what the kernels before this call wrote; it has written the
  // result when it returns, before any later kernel on the stream runs.
  MPI4JAX_DIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  return AllreduceChunked(out, out, count, element_bytes, dtype, op, comm,
                          chunk_bytes);
}

// Each chunk goes device -> pinned host -> MPI -> device.
ffi::Error AllreduceStaged(cudaStream_t stream, const char* in, char* out,
                           size_t count, size_t element_bytes,
                           MPI_Datatype dtype, MPI_Op op, MPI_Comm comm,
                           int64_t chunk_bytes) {
  CudaStats& stats = GetCudaStats();
  stats.staged_calls.fetch_add(1, std::memory_order_relaxed);
  const size_t per_call =
      std::min(ElementsPerCall(chunk_bytes, element_bytes), count);
  PinnedPool::Buffer host;
  if (ffi::Error error = Pool().Take(per_call * element_bytes, &host);
      error.failure()) {
    return error;
  }
  ffi::Error result = ffi::Error::Success();
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(per_call, count - done);
    const size_t offset = done * element_bytes;
    const size_t bytes = n * element_bytes;
    // The copy follows the kernels before this call on XLA's stream, and the
    // previous chunk's copy back, which still reads the host buffer.
    cudaError_t rc = cudaMemcpyAsync(host.data, in + offset, bytes,
                                     cudaMemcpyDeviceToHost, stream);
    if (rc == cudaSuccess) rc = cudaStreamSynchronize(stream);
    if (rc != cudaSuccess) {
      result = CudaError("copying a chunk to the host", rc);
      break;
    }
    result = AllreduceChunk(host.data, n, dtype, op, comm);
    if (result.failure()) break;
    rc = cudaMemcpyAsync(out + offset, host.data, bytes,
                         cudaMemcpyHostToDevice, stream);
    if (rc != cudaSuccess) {
      result = CudaError("copying a chunk back to the device", rc);
      break;
    }
    stats.staged_chunks.fetch_add(1, std::memory_order_relaxed);
    done += n;
  }
  // The last copy back reads the host buffer: it must be done before another
  // call may take the buffer.
  const cudaError_t rc = cudaStreamSynchronize(stream);
  Pool().Give(host);
  if (result.success() && rc != cudaSuccess) {
    result = CudaError("cudaStreamSynchronize", rc);
  }
  return result;
}

// x and a token in, the reduced x out (aliased with x by the lowering), as on
// the CPU; the token orders the call after every earlier MPI call.
ffi::Error AllreduceCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Token,
                             ffi::Result<ffi::AnyBuffer> y,
                             int64_t comm_id, int32_t op_code,
                             int64_t chunk_bytes, int32_t cuda_aware,
                             int32_t check) {
  CountHandlerCall(x.untyped_data(), y->untyped_data());
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  if (ffi::Error error =
          CheckAllreduce(x, *y, comm_id, op_code, chunk_bytes,
                         check ? Agreement::kEveryCall : Agreement::kFirstCall,
                         &dtype, &op, &comm);
      error.failure()) {
    return error;
  }
  const size_t count = x.element_count();
  if (count == 0) return ffi::Error::Success();
  if (ffi::Error error = UseDeviceOf(y->untyped_data()); error.failure()) {
    return error;
  }
  const char* in = static_cast<const char*>(x.untyped_data());
  char* out = static_cast<char*>(y->untyped_data());
  const size_t element_bytes = x.size_bytes() / count;
  return cuda_aware ? AllreduceCudaAware(stream, in, out, count, element_bytes,
                                         dtype, op, comm, chunk_bytes)
                    : AllreduceStaged(stream, in, out, count, element_bytes,
                                      dtype, op, comm, chunk_bytes);
}

}  // namespace
}  // namespace mpi4jax_dist

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Mpi4jaxDistAllreduceCuda, mpi4jax_dist::AllreduceCudaImpl,
    xla::ffi::Ffi::Bind()
        .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
        .Arg<xla::ffi::AnyBuffer>()
        .Arg<xla::ffi::Token>()
        .Ret<xla::ffi::AnyBuffer>()
        .Attr<int64_t>("comm")
        .Attr<int32_t>("op")
        .Attr<int64_t>("chunk_bytes")
        .Attr<int32_t>("cuda_aware")
        .Attr<int32_t>("check"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistTokenAfterCuda,
                              mpi4jax_dist::TokenAfterImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Token>());

// ---------------------------------------------------------------------------
// The Python module: the handlers as capsules, and what the MPI and CUDA are.

namespace {

PyObject* Handler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistAllreduceCuda),
                       nullptr, nullptr);
}

PyObject* TokenHandler(PyObject*, PyObject*) {
  return PyCapsule_New(reinterpret_cast<void*>(&Mpi4jaxDistTokenAfterCuda),
                       nullptr, nullptr);
}

// Whether the MPI library says it can read device memory: True, False, or
// None where it has no way to say (call after MPI_Init).
PyObject* MpiCudaSupport(PyObject*, PyObject*) {
#if defined(OPEN_MPI) && OPEN_MPI && defined(OMPI_HAVE_MPI_EXT_CUDA) && \
    OMPI_HAVE_MPI_EXT_CUDA
  return PyBool_FromLong(MPIX_Query_cuda_support());
#elif defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40100000
  return PyBool_FromLong(MPIX_Query_cuda_support());
#else
  Py_RETURN_NONE;
#endif
}

// Frees the idle pinned staging buffers; returns the bytes freed.
PyObject* ReleasePinned(PyObject*, PyObject*) {
  size_t freed;
  Py_BEGIN_ALLOW_THREADS
  freed = mpi4jax_dist::Pool().Release();
  Py_END_ALLOW_THREADS
  return PyLong_FromSize_t(freed);
}

// The platform's counts and CUDA's own: staging, pinned memory.
PyObject* GetStatsDict(PyObject*, PyObject*) {
  PyObject* stats = mpi4jax_dist::StatsDict();
  if (stats == nullptr) return nullptr;
  const mpi4jax_dist::CudaStats& c = mpi4jax_dist::GetCudaStats();
  const std::pair<const char*, int64_t> cuda[] = {
      {"cuda_aware_calls", c.cuda_aware_calls.load()},
      {"staged_calls", c.staged_calls.load()},
      {"staged_chunks", c.staged_chunks.load()},
      {"pinned_bytes", c.pinned_bytes.load()},
      {"pinned_peak_bytes", c.pinned_peak_bytes.load()},
  };
  for (const auto& [name, value] : cuda) {
    PyObject* number = PyLong_FromLongLong(value);
    if (number == nullptr || PyDict_SetItemString(stats, name, number) < 0) {
      Py_XDECREF(number);
      Py_DECREF(stats);
      return nullptr;
    }
    Py_DECREF(number);
  }
  return stats;
}

// Zero the counts; pinned_bytes (what is allocated now) stays, and the peak
// restarts from it.
PyObject* ResetStats(PyObject*, PyObject*) {
  mpi4jax_dist::GetStats().Reset();
  mpi4jax_dist::CudaStats& c = mpi4jax_dist::GetCudaStats();
  c.cuda_aware_calls = 0;
  c.staged_calls = 0;
  c.staged_chunks = 0;
  c.pinned_peak_bytes = c.pinned_bytes.load();
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"register_comm", mpi4jax_dist::RegisterComm, METH_VARARGS,
     "register_comm(fortran_handle): the communicator's id for compiled calls "
     "(see CommRegistry in mpi_helpers.h). MPI must be initialized."},
    {"allreduce_handler", Handler, METH_NOARGS,
     "Return the XLA FFI handler of the CUDA allreduce as a PyCapsule."},
    {"token_after_handler", TokenHandler, METH_NOARGS,
     "Return the XLA FFI handler that makes a token after a buffer."},
    {"library_version", mpi4jax_dist::LibraryVersion, METH_NOARGS,
     "Return MPI_Get_library_version() of the MPI this module calls."},
    {"mpi_cuda_support", MpiCudaSupport, METH_NOARGS,
     "Return whether the MPI library says it reads device memory (True or "
     "False), or None where it cannot say. MPI must be initialized."},
    {"release_pinned", ReleasePinned, METH_NOARGS,
     "Free the idle pinned host staging buffers; return the bytes freed."},
    {"stats", GetStatsDict, METH_NOARGS,
     "Return counts of handler calls, the MPI calls they made, and staging."},
    {"reset_stats", ResetStats, METH_NOARGS, "Set every count to zero."},
    {nullptr, nullptr, 0, nullptr},
};

#define MPI4JAX_DIST_STR2(x) #x
#define MPI4JAX_DIST_STR(x) MPI4JAX_DIST_STR2(x)
#define MPI4JAX_DIST_CAT2(a, b) a##b
#define MPI4JAX_DIST_CAT(a, b) MPI4JAX_DIST_CAT2(a, b)

#ifndef MPI4JAX_DIST_MODULE
#error "setup.py defines MPI4JAX_DIST_MODULE, the module's name (_cuda_mpich)"
#endif

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    MPI4JAX_DIST_STR(MPI4JAX_DIST_MODULE),
    "mpi4jax_dist's XLA FFI handlers for CUDA, built against one MPI.",
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
      // Whether the blocking allreduce calls MPI_Allreduce_c (mpi_helpers.h).
      PyModule_AddObject(module, "ALLREDUCE_LARGE_COUNT",
                         PyBool_FromLong(MPI4JAX_DIST_ALLREDUCE_C)) < 0 ||
      // The CUDA runtime this module was compiled against (13000: CUDA 13.0).
      PyModule_AddIntConstant(module, "CUDART_VERSION", CUDART_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
