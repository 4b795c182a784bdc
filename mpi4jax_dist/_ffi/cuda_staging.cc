// The CUDA allreduce's device-side path (cuda_staging.h), in _cuda: the
// pinned staging buffers and the CUDA counts are the CUDA module's own; the
// host reduction, the registry and the shared counts are the core's.

#include "cuda_staging.h"

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

namespace mpi4jax_dist {

CudaStats& GetCudaStats() {
  static CudaStats stats;
  return stats;
}

// The CUDA counts, named as the module's stats() names them.
StatsItems GetCudaStatsItems() {
  const CudaStats& c = GetCudaStats();
  return {
      {"cuda_aware_calls", c.cuda_aware_calls.load()},
      {"staged_calls", c.staged_calls.load()},
      {"staged_chunks", c.staged_chunks.load()},
      {"pinned_bytes", c.pinned_bytes.load()},
      {"pinned_peak_bytes", c.pinned_peak_bytes.load()},
  };
}

// Zero the counts; pinned_bytes (what is allocated now) stays, and the peak
// restarts from it.
void ResetCudaStats() {
  CudaStats& c = GetCudaStats();
  c.cuda_aware_calls = 0;
  c.staged_calls = 0;
  c.staged_chunks = 0;
  c.pinned_peak_bytes = c.pinned_bytes.load();
}

namespace {

ffi::Error CudaError(const char* what, cudaError_t code) {
  return ffi::Error::Internal(std::string("mpi4jax_dist.allreduce: ") + what +
                              " failed with " + cudaGetErrorName(code) + ": " +
                              cudaGetErrorString(code));
}

#define MPI4JAX_DIST_CUDA_CHECK(call)           \
  do {                                          \
    const cudaError_t mpi4jax_dist_rc = (call); \
    if (mpi4jax_dist_rc != cudaSuccess)         \
      return CudaError(#call, mpi4jax_dist_rc); \
  } while (0)

}  // namespace

bool PinnedPool::SetBytes(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes != bytes_ && count_ > 0) return false;
  bytes_ = bytes;
  return true;
}

size_t PinnedPool::bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_;
}

ffi::Error PinnedPool::Take(Buffer* out) {
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

void PinnedPool::Give(const Buffer& buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.push_back(buffer);
}

size_t PinnedPool::Release() {
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

// Never destroyed: at exit the CUDA runtime may be gone before static
// destructors run. Python frees the buffers earlier (atexit -> release_pinned).
PinnedPool& Pool() {
  static PinnedPool* pool = new PinnedPool();
  return *pool;
}

namespace {

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
    MPI4JAX_DIST_CUDA_CHECK(cudaMemcpyAsync(out, in, count * element_bytes,
                                            cudaMemcpyDeviceToDevice, stream));
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

}  // namespace

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

}  // namespace mpi4jax_dist
