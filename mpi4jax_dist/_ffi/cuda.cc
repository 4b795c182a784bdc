// The CUDA handler of mpi4jax_dist.allreduce, and the Python module that hands
// it to JAX (jax.ffi.register_ffi_target(..., platform="CUDA")).
//
// Plain C++ over the CUDA runtime API (no kernels): conf/builder.py compiles it
// with the host compiler where CUDA headers exist, into _cuda beside the CPU
// module, so that the CPU module never depends on CUDA. Two ways to reduce a device buffer, chosen per compiled call by the
// `cuda_aware` attribute (MPI4JAX_DIST_CUDA_AWARE_MPI, see _config.py):
//
// - CUDA-aware MPI: wait for the stream, then MPI reduces the device buffer in
//   place, in chunks as on the CPU. Device memory: the message.
// - Staged (the default): the message goes in pieces through the two halves of
//   one pinned host buffer of MPI4JAX_DIST_STAGING_BYTES (64 MiB; a piece is at
//   most half of it, and at most chunk_bytes): while MPI reduces piece i in one
//   half, piece i + 1 is copied device -> host into the other, and piece i - 1
//   host -> device out of it, all on XLA's stream. Device memory: the message;
//   host memory: the buffer, allocated on the first call and kept (freeing
//   pinned memory synchronizes the device), reused by every later call.
//
// Both first wait for XLA's stream, so that a kernel that failed before the
// call is reported as such, not as a failed copy.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "allreduce.h"
#include "module_helpers.h"
#include "stats.h"
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
  // Pieces copied to the host and back (each one MPI call).
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

// The staging buffer's size, as _config.staging_bytes() says (load_cuda sets it
// before the first call; this default is the same).
constexpr size_t kDefaultStagingBytes = size_t{64} << 20;
// Each half holds one element of the largest type (complex128) at least.
constexpr size_t kMinStagingBytes = 32;
// A half's size is a multiple of this, so that every element stays aligned in
// the second half too.
constexpr size_t kHalfAlign = 16;

// Pinned host buffers for staging, all of one size: one per call running at
// once (normally one per process). A call takes an idle buffer, or allocates a
// new one when every buffer is in use, and gives it back when done. Buffers are
// never freed or regrown while the program runs: cudaFreeHost waits for the
// whole device. They live until ReleasePinned() (Python calls it at exit).
class PinnedPool {
 public:
  struct Buffer {
    char* data = nullptr;
    size_t bytes = 0;
  };

  // Sets the size of the buffers; refused (false) while any exists with
  // another size.
  bool SetBytes(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes != bytes_ && count_ > 0) return false;
    bytes_ = bytes;
    return true;
  }

  size_t bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return bytes_;
  }

  // An idle buffer, or a new one.
  ffi::Error Take(Buffer* out) {
    size_t bytes;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        *out = idle_.back();
        idle_.pop_back();
        return ffi::Error::Success();
      }
      bytes = bytes_;
      // Counted now, so that SetBytes cannot change the size meanwhile.
      ++count_;
    }
    Buffer buffer;
    // Portable: usable whichever device's context the next call runs in.
    const cudaError_t rc = cudaHostAlloc(reinterpret_cast<void**>(&buffer.data),
                                         bytes, cudaHostAllocPortable);
    if (rc != cudaSuccess) {
      std::lock_guard<std::mutex> lock(mutex_);
      --count_;
      return ffi::Error(
          ffi::ErrorCode::kResourceExhausted,
          std::string("mpi4jax_dist.allreduce: pinning ") +
              std::to_string(bytes) +
              " bytes of host memory for staging (cudaHostAlloc) failed with " +
              cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc) +
              ". Set MPI4JAX_DIST_STAGING_BYTES lower (default 64M), or "
              "MPI4JAX_DIST_CUDA_AWARE_MPI=1 where the MPI reads device "
              "memory.");
    }
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
      count_ -= idle.size();
    }
    size_t freed = 0;
    for (const Buffer& buffer : idle) {
      freed += buffer.bytes;
      // An error here (the CUDA runtime already shut down at exit) leaves the
      // memory to the operating system, which reclaims it with the process.
      cudaFreeHost(buffer.data);
      GetCudaStats().pinned_bytes.fetch_sub(static_cast<int64_t>(buffer.bytes));
    }
    return freed;
  }

 private:
  std::mutex mutex_;
  size_t bytes_ = kDefaultStagingBytes;
  // Buffers allocated and not freed, idle or in use.
  size_t count_ = 0;
  std::vector<Buffer> idle_;
};

// Never destroyed: at exit the CUDA runtime may be gone before static
// destructors run. Python frees the buffers earlier (atexit -> release_pinned).
PinnedPool& Pool() {
  static PinnedPool* pool = new PinnedPool();
  return *pool;
}

// Waits for the work XLA queued on the stream before this call. A kernel that
// failed asynchronously (an illegal address, say) surfaces in the first CUDA
// call after it: here, so that it is reported as that kernel's failure rather
// than as a failed copy of the allreduce. (The runtime's per-thread last error
// is left alone: any earlier runtime call on this thread may have left one
// there, harmless or not ours.)
ffi::Error CheckEarlierWork(cudaStream_t stream) {
  const cudaError_t rc = cudaStreamSynchronize(stream);
  if (rc == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(
      std::string("mpi4jax_dist.allreduce: an earlier kernel on this stream "
                  "failed: ") +
      cudaGetErrorName(rc) + ": " + cudaGetErrorString(rc) +
      " (found when the allreduce waited for the work before it, before it "
      "touched its buffer; CUDA_LAUNCH_BLOCKING=1 makes the failing kernel "
      "report it itself)");
}

// Makes the buffer's device current on this thread for the call, and the
// previous one current again when the call ends: the runtime API works on the
// current device, XLA's thread need not have made the buffer's current (a
// process may drive several GPUs), and what runs next on this thread must find
// the device it left. A host pointer changes nothing.
class DeviceScope {
 public:
  DeviceScope() = default;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ~DeviceScope() {
    // A failure here has no one to report to; the call's own result stands.
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

  ffi::Error Enter(const void* data) {
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
      previous_ = current;
    }
    return ffi::Error::Success();
  }

 private:
  int previous_ = -1;
};

// MPI reads and writes device memory itself.
ffi::Error AllreduceCudaAware(cudaStream_t stream, const char* in, char* out,
                              size_t count, size_t element_bytes,
                              MPI_Datatype dtype, MPI_Op op, MPI_Comm comm,
                              int64_t chunk_bytes) {
  GetCudaStats().cuda_aware_calls.fetch_add(1, std::memory_order_relaxed);
  // The caller has waited for the kernels before this call (CheckEarlierWork):
  // MPI sees what they wrote.
  if (in != out) {
    MPI4JAX_DIST_CUDA_CHECK(cudaMemcpyAsync(
        out, in, count * element_bytes, cudaMemcpyDeviceToDevice, stream));
    // MPI must see the copy; it has written the result when it returns,
    // before any later kernel on the stream runs.
    MPI4JAX_DIST_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return AllreduceChunked(out, out, count, element_bytes, dtype, op, comm,
                          chunk_bytes);
}

// The events that mark the end of each half's copy in, for one staged call.
// cudaEventDestroy does not wait: one still pending is freed when it completes.
struct CopyInEvents {
  cudaEvent_t done[2] = {nullptr, nullptr};

  CopyInEvents() = default;
  CopyInEvents(const CopyInEvents&) = delete;
  CopyInEvents& operator=(const CopyInEvents&) = delete;
  ~CopyInEvents() {
    for (cudaEvent_t event : done) {
      if (event != nullptr) cudaEventDestroy(event);
    }
  }

  cudaError_t Create() {
    for (cudaEvent_t& event : done) {
      const cudaError_t rc =
          cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
      if (rc != cudaSuccess) return rc;
    }
    return cudaSuccess;
  }
};

// The message goes in pieces through the two halves of a pinned buffer, piece
// i in half i % 2. On XLA's stream, in this order: copy in 0, copy in 1, copy
// back 0, copy in 2, copy back 1, ...; on the host, MPI reduces piece i once
// its copy in is done, while the stream copies piece i + 1 in and piece i - 1
// back. Two rules keep the halves consistent, and both follow from that order:
// MPI reads a half only after its copy in has completed (the event), and a
// copy in overwrites a half only after the copy back of the piece before it
// there, which was queued earlier on the same stream, has read it (so also
// MPI, which waits for that copy in, never writes a half a copy back reads).
ffi::Error AllreduceStaged(cudaStream_t stream, const char* in, char* out,
                           size_t count, size_t element_bytes,
                           MPI_Datatype dtype, MPI_Op op, MPI_Comm comm,
                           int64_t chunk_bytes) {
  CudaStats& stats = GetCudaStats();
  stats.staged_calls.fetch_add(1, std::memory_order_relaxed);
  PinnedPool::Buffer host;
  if (ffi::Error error = Pool().Take(&host); error.failure()) return error;
  const size_t half_bytes = host.bytes / 2 / kHalfAlign * kHalfAlign;
  char* const halves[2] = {host.data, host.data + half_bytes};
  // A piece fits a half, and one MPI call (chunk_bytes, INT_MAX elements).
  const size_t per_piece =
      std::min({half_bytes / element_bytes,
                ElementsPerCall(chunk_bytes, element_bytes), count});
  const size_t pieces = (count + per_piece - 1) / per_piece;
  auto piece_elements = [&](size_t i) {
    return std::min(per_piece, count - i * per_piece);
  };
  CopyInEvents events;
  cudaError_t rc = events.Create();
  ffi::Error result = rc == cudaSuccess
                          ? ffi::Error::Success()
                          : CudaError("cudaEventCreateWithFlags", rc);
  auto copy_in = [&](size_t i) {
    cudaError_t rc = cudaMemcpyAsync(
        halves[i % 2], in + i * per_piece * element_bytes,
        piece_elements(i) * element_bytes, cudaMemcpyDeviceToHost, stream);
    if (rc == cudaSuccess) rc = cudaEventRecord(events.done[i % 2], stream);
    return rc;
  };
  if (result.success() && (rc = copy_in(0)) != cudaSuccess) {
    result = CudaError("copying a piece to the host", rc);
  }
  for (size_t i = 0; result.success() && i < pieces; ++i) {
    // The next piece comes in while this one is reduced.
    if (i + 1 < pieces && (rc = copy_in(i + 1)) != cudaSuccess) {
      result = CudaError("copying a piece to the host", rc);
      break;
    }
    if ((rc = cudaEventSynchronize(events.done[i % 2])) != cudaSuccess) {
      result = CudaError("copying a piece to the host", rc);
      break;
    }
    const size_t n = piece_elements(i);
    result = AllreduceChunk(halves[i % 2], n, dtype, op, comm);
    if (result.failure()) break;
    // Back to the device while the next piece is reduced.
    rc = cudaMemcpyAsync(out + i * per_piece * element_bytes, halves[i % 2],
                         n * element_bytes, cudaMemcpyHostToDevice, stream);
    if (rc != cudaSuccess) {
      result = CudaError("copying a piece back to the device", rc);
      break;
    }
    stats.staged_chunks.fetch_add(1, std::memory_order_relaxed);
  }
  // Every copy queued reads or writes the buffer (after a failure too): all
  // must be done before another call may take it.
  rc = cudaStreamSynchronize(stream);
  Pool().Give(host);
  if (result.success() && rc != cudaSuccess) {
    result = CudaError("copying the pieces back to the device", rc);
  }
  return result;
}

// Reduces `count` elements of device memory from `in` into `out` (one buffer
// when XLA aliased them), after the work queued before on `stream`: by MPI on
// the device buffer, or staged through pinned host memory. What the handler
// does once its arguments are checked (tests/cuda_fake runs it on the CPU).
ffi::Error ReduceDeviceBuffer(cudaStream_t stream, const char* in, char* out,
                              size_t count, size_t element_bytes,
                              MPI_Datatype dtype, MPI_Op op, MPI_Comm comm,
                              int64_t chunk_bytes, bool cuda_aware) {
  if (ffi::Error error = CheckEarlierWork(stream); error.failure()) {
    return error;
  }
  DeviceScope device;
  if (ffi::Error error = device.Enter(out); error.failure()) return error;
  return cuda_aware ? AllreduceCudaAware(stream, in, out, count, element_bytes,
                                         dtype, op, comm, chunk_bytes)
                    : AllreduceStaged(stream, in, out, count, element_bytes,
                                      dtype, op, comm, chunk_bytes);
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
                         AgreementFor(check),
                         &dtype, &op, &comm);
      error.failure()) {
    return error;
  }
  const size_t count = x.element_count();
  if (count == 0) return ffi::Error::Success();
  return ReduceDeviceBuffer(stream, static_cast<const char*>(x.untyped_data()),
                            static_cast<char*>(y->untyped_data()), count,
                            x.size_bytes() / count, dtype, op, comm,
                            chunk_bytes, cuda_aware != 0);
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
// None where it has no way to say, and while MPI is not initialized or already
// finalized: MPICH's query ends the process then ("Attempting to use an MPI
// routine ... before initializing"), as mpiabi.c's query_support knows.
PyObject* MpiCudaSupport(PyObject*, PyObject*) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) Py_RETURN_NONE;
#if defined(OPEN_MPI) && OPEN_MPI && defined(OMPI_HAVE_MPI_EXT_CUDA) && \
    OMPI_HAVE_MPI_EXT_CUDA
  return PyBool_FromLong(MPIX_Query_cuda_support());
#elif defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40100000
  return PyBool_FromLong(MPIX_Query_cuda_support());
#else
  Py_RETURN_NONE;
#endif
}

// The newest CUDA the driver runs (cudaDriverGetVersion: 12080 for 12.8), 0
// where no driver is installed; load_cuda compares it with CUDART_VERSION.
PyObject* DriverVersion(PyObject*, PyObject*) {
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) version = 0;
  return PyLong_FromLong(version);
}

// Sets the size of the pinned staging buffers (load_cuda: from
// MPI4JAX_DIST_STAGING_BYTES); refused while buffers of another size exist.
PyObject* SetStagingBytes(PyObject*, PyObject* args) {
  unsigned long long bytes = 0;
  if (!PyArg_ParseTuple(args, "K", &bytes)) return nullptr;
  if (bytes < mpi4jax_dist::kMinStagingBytes ||
      bytes > static_cast<unsigned long long>(SIZE_MAX)) {
    PyErr_Format(PyExc_ValueError,
                 "set_staging_bytes(%llu): the staging buffer needs at least "
                 "%zu bytes (two elements of the largest type)",
                 bytes, mpi4jax_dist::kMinStagingBytes);
    return nullptr;
  }
  if (!mpi4jax_dist::Pool().SetBytes(static_cast<size_t>(bytes))) {
    PyErr_Format(PyExc_RuntimeError,
                 "set_staging_bytes(%llu): pinned staging buffers of %zu bytes "
                 "exist already; call release_pinned() first, while no "
                 "allreduce runs",
                 bytes, mpi4jax_dist::Pool().bytes());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* StagingBytes(PyObject*, PyObject*) {
  return PyLong_FromSize_t(mpi4jax_dist::Pool().bytes());
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
    MPI4JAX_DIST_TIMEOUT_METHODS
    {"register_comm", mpi4jax_dist::RegisterComm, METH_VARARGS,
     "register_comm(fortran_handle): the communicator's id for compiled calls "
     "(see CommRegistry in comm_registry.h). MPI must be initialized."},
    {"allreduce_handler", Handler, METH_NOARGS,
     "Return the XLA FFI handler of the CUDA allreduce as a PyCapsule."},
    {"token_after_handler", TokenHandler, METH_NOARGS,
     "Return the XLA FFI handler that makes a token after a buffer."},
    {"library_version", mpi4jax_dist::LibraryVersion, METH_NOARGS,
     "Return MPI_Get_library_version() of the MPI this module calls."},
    {"mpi_cuda_support", MpiCudaSupport, METH_NOARGS,
     "Return whether the MPI library says it reads device memory (True or "
     "False), or None where it cannot say, and while MPI is not initialized "
     "or already finalized."},
    {"driver_version", DriverVersion, METH_NOARGS,
     "Return cudaDriverGetVersion(): the newest CUDA the driver runs (12080 "
     "for 12.8), or 0 where no driver is installed."},
    {"set_staging_bytes", SetStagingBytes, METH_VARARGS,
     "set_staging_bytes(n): pin staging buffers of n bytes (two halves) from "
     "now on; refused while buffers of another size exist."},
    {"staging_bytes", StagingBytes, METH_NOARGS,
     "Return the size of the pinned staging buffers, in bytes."},
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
#error "conf/builder.py defines MPI4JAX_DIST_MODULE, the module's name (_cuda)"
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
      // Whether the blocking allreduce calls MPI_Allreduce_c (mpi_base.h).
      PyModule_AddObject(module, "ALLREDUCE_LARGE_COUNT",
                         PyBool_FromLong(MPI4JAX_DIST_ALLREDUCE_C)) < 0 ||
      // The CUDA runtime this module was compiled against (13000: CUDA 13.0).
      PyModule_AddIntConstant(module, "CUDART_VERSION", CUDART_VERSION) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
