// The CUDA allreduce's device-side path (ReduceDeviceBuffer): a device buffer
// reduced by a CUDA-aware MPI in place, or staged through the two halves of one
// pinned host buffer, one half copied while MPI reduces the other. Plain C++
// over the CUDA runtime API (no kernels); tests/cuda_fake runs it on the CPU
// over a fake runtime. docs/design.rst ("The in-place allreduce") says why.

#ifndef MPI4JAX_DIST_FFI_CUDA_STAGING_H_
#define MPI4JAX_DIST_FFI_CUDA_STAGING_H_

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "mpi_base.h"
#include "stats.h"

namespace mpi4jax_dist {

// What the CUDA handler did beyond the shared Stats (op_counts' CUDA keys).
struct CudaStats {
  std::atomic<int64_t> cuda_aware_calls{0};
  std::atomic<int64_t> staged_calls{0};
  // Pieces copied to the host and back (each one MPI call).
  std::atomic<int64_t> staged_chunks{0};
  // Pinned host bytes allocated now, and the most ever at once.
  std::atomic<int64_t> pinned_bytes{0};
  std::atomic<int64_t> pinned_peak_bytes{0};
};

// The CUDA counts: the CUDA module's own (one a process: one _cuda).
CudaStats& GetCudaStats();

// The CUDA counts, named as the module's stats() names them.
StatsItems GetCudaStatsItems();

// Zero the counts; pinned_bytes (what is allocated now) stays, and the peak
// restarts from it.
void ResetCudaStats();

// The staging buffer's size, as _config.staging_bytes() says (load_cuda sets it
// before the first call; this default is the same).
inline constexpr size_t kDefaultStagingBytes = size_t{64} << 20;
// Each half holds one element of the largest type (complex128) at least.
inline constexpr size_t kMinStagingBytes = 32;
// A half's size is a multiple of this, so that every element stays aligned in
// the second half too.
inline constexpr size_t kHalfAlign = 16;

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
  bool SetBytes(size_t bytes);

  size_t bytes();

  // An idle buffer, or a new one.
  ffi::Error Take(Buffer* out);

  void Give(const Buffer& buffer);

  // Free every idle buffer; returns the bytes freed.
  size_t Release();

 private:
  std::mutex mutex_;
  size_t bytes_ = kDefaultStagingBytes;
  // Buffers allocated and not freed, idle or in use.
  size_t count_ = 0;
  std::vector<Buffer> idle_;
};

// The process's pool. Never destroyed: at exit the CUDA runtime may be gone
// before static destructors run. Python frees the buffers earlier (atexit ->
// release_pinned).
PinnedPool& Pool();

// Reduces `count` elements of device memory from `in` into `out` (one buffer
// when XLA aliased them), after the work queued before on `stream`: by MPI on
// the device buffer, or staged through pinned host memory (the two halves of
// one pinned buffer, one half copied while MPI reduces the other). What the
// handler does once its arguments are checked (tests/cuda_fake runs it on the
// CPU).
ffi::Error ReduceDeviceBuffer(cudaStream_t stream, const char* in, char* out,
                              size_t count, size_t element_bytes,
                              MPI_Datatype dtype, MPI_Op op, MPI_Comm comm,
                              int64_t chunk_bytes, bool cuda_aware);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_CUDA_STAGING_H_
