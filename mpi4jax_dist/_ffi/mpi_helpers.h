// MPI helpers shared by the platform handlers of mpi4jax_dist: cpu.cc, and
// cuda.cc, which reduces device memory in place (CUDA-aware MPI) or stages it
// through a bounded pinned host chunk, one AllreduceChunk call per chunk.
//
// Everything here is header-only so that each platform source builds alone.

#ifndef MPI4JAX_DIST_FFI_MPI_HELPERS_H_
#define MPI4JAX_DIST_FFI_MPI_HELPERS_H_

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

// MPI-4 brought the large-count ("_c") functions: MPICH >= 4 has them, Open MPI
// 5.0 (whose headers say MPI 3.1) does not. Without them a call takes at most
// INT_MAX elements, and larger messages go in chunks.
#if defined(MPI_VERSION) && MPI_VERSION >= 4
#define MPI4JAX_DIST_LARGE_COUNT 1
#else
#define MPI4JAX_DIST_LARGE_COUNT 0
#endif

namespace mpi4jax_dist {

namespace ffi = xla::ffi;

// What the handlers did, for the tests: a count of what ran, not of what was
// asked for. Relaxed atomics: handlers run on XLA's worker threads.
struct Stats {
  std::atomic<int64_t> handler_calls{0};
  // Handler calls where XLA gave one buffer for operand and result (in place).
  std::atomic<int64_t> same_buffer_calls{0};
  // MPI reduction calls made, and of those the large-count (MPI_Allreduce_c) ones.
  std::atomic<int64_t> mpi_calls{0};
  std::atomic<int64_t> large_count_calls{0};
  // Largest element count handed to one MPI call.
  std::atomic<int64_t> max_call_count{0};

  void Reset() {
    handler_calls = 0;
    same_buffer_calls = 0;
    mpi_calls = 0;
    large_count_calls = 0;
    max_call_count = 0;
  }
};

inline Stats& GetStats() {
  static Stats stats;
  return stats;
}

// Count a handler call, and whether XLA gave it one buffer (in place).
inline void CountHandlerCall(const void* operand, const void* result) {
  Stats& stats = GetStats();
  stats.handler_calls.fetch_add(1, std::memory_order_relaxed);
  if (operand == result) {
    stats.same_buffer_calls.fetch_add(1, std::memory_order_relaxed);
  }
}

// Reduction ops, numbered as mpi4jax_dist/_allreduce.py numbers them (_OPS).
inline bool OpFromCode(int32_t code, MPI_Op* op) {
  static const MPI_Op kOps[] = {MPI_SUM,  MPI_PROD, MPI_MIN,  MPI_MAX,
                                MPI_LAND, MPI_LOR,  MPI_LXOR, MPI_BAND,
                                MPI_BOR,  MPI_BXOR};
  if (code < 0 || code >= static_cast<int32_t>(sizeof(kOps) / sizeof(kOps[0])))
    return false;
  *op = kOps[code];
  return true;
}

// The MPI datatype of an XLA element type; false for the ones MPI cannot reduce
// (the Python side refuses those before any MPI call, this is the backstop).
inline bool DatatypeOf(ffi::DataType dtype, MPI_Datatype* out) {
  switch (dtype) {
    case ffi::DataType::PRED:
      *out = MPI_C_BOOL;
      return true;
    case ffi::DataType::S8:
      *out = MPI_INT8_T;
      return true;
    case ffi::DataType::S16:
      *out = MPI_INT16_T;
      return true;
    case ffi::DataType::S32:
      *out = MPI_INT32_T;
      return true;
    case ffi::DataType::S64:
      *out = MPI_INT64_T;
      return true;
    case ffi::DataType::U8:
      *out = MPI_UINT8_T;
      return true;
    case ffi::DataType::U16:
      *out = MPI_UINT16_T;
      return true;
    case ffi::DataType::U32:
      *out = MPI_UINT32_T;
      return true;
    case ffi::DataType::U64:
      *out = MPI_UINT64_T;
      return true;
    case ffi::DataType::F32:
      *out = MPI_FLOAT;
      return true;
    case ffi::DataType::F64:
      *out = MPI_DOUBLE;
      return true;
    case ffi::DataType::C64:
      *out = MPI_C_FLOAT_COMPLEX;
      return true;
    case ffi::DataType::C128:
      *out = MPI_C_DOUBLE_COMPLEX;
      return true;
    default:
      return false;
  }
}

// "MPI_Allreduce failed: <MPI's own words>" for an MPI error code.
inline ffi::Error MpiError(const char* what, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = 0;
  }
  return ffi::Error::Internal(std::string("mpi4jax_dist.allreduce: ") + what +
                              " failed with MPI error " + std::to_string(code) +
                              ": " + std::string(text, length));
}

// MPI must be up (and not yet finalized) before a handler may call it: a
// clear error instead of MPI's abort.
inline ffi::Error CheckMpiUsable() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string("mpi4jax_dist.allreduce: MPI is ") +
            (finalized ? "already finalized" : "not initialized") +
            "; import mpi4py.MPI before the call and keep MPI up until the "
            "last one has run.");
  }
  return ffi::Error::Success();
}

// One MPI allreduce of `count` elements in place (sendbuf MPI_IN_PLACE).
inline int AllreduceOnce(void* data, size_t count, MPI_Datatype dtype,
                         MPI_Op op, MPI_Comm comm) {
  Stats& stats = GetStats();
  stats.mpi_calls.fetch_add(1, std::memory_order_relaxed);
  int64_t seen = stats.max_call_count.load(std::memory_order_relaxed);
  while (static_cast<int64_t>(count) > seen &&
         !stats.max_call_count.compare_exchange_weak(
             seen, static_cast<int64_t>(count), std::memory_order_relaxed)) {
  }
#if MPI4JAX_DIST_LARGE_COUNT
  if (count > static_cast<size_t>(INT_MAX)) {
    stats.large_count_calls.fetch_add(1, std::memory_order_relaxed);
    return MPI_Allreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                           dtype, op, comm);
  }
#endif
  return MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype, op,
                       comm);
}

// The largest number of elements one MPI call may take: `chunk_bytes` worth
// (0: no limit), and at most INT_MAX where the MPI has no large-count calls.
inline size_t ElementsPerCall(int64_t chunk_bytes, size_t element_bytes) {
  size_t limit = SIZE_MAX;
  if (chunk_bytes > 0) {
    limit = std::max<size_t>(1, static_cast<size_t>(chunk_bytes) /
                                    std::max<size_t>(1, element_bytes));
  }
#if !MPI4JAX_DIST_LARGE_COUNT
  limit = std::min(limit, static_cast<size_t>(INT_MAX));
#endif
  return limit;
}

// One MPI reduction of `n` elements in place, its failure as an ffi::Error.
inline ffi::Error AllreduceChunk(void* data, size_t n, MPI_Datatype dtype,
                                 MPI_Op op, MPI_Comm comm) {
  const int rc = AllreduceOnce(data, n, dtype, op, comm);
  if (rc != MPI_SUCCESS) {
    return MpiError(MPI4JAX_DIST_LARGE_COUNT && n > INT_MAX ? "MPI_Allreduce_c"
                                                            : "MPI_Allreduce",
                    rc);
  }
  return ffi::Error::Success();
}

// Allreduce `count` elements of host memory from `in` into `out`, chunk by
// chunk so that MPI's scratch memory is bounded by one chunk.
//
// The MPI standard asks for MPI_IN_PLACE on all ranks or none; every rank
// passes it here. When XLA gives two buffers, each chunk is first copied to
// the result and then reduced in place there.
inline ffi::Error AllreduceChunked(const void* in, void* out, size_t count,
                                   size_t element_bytes, MPI_Datatype dtype,
                                   MPI_Op op, MPI_Comm comm,
                                   int64_t chunk_bytes) {
  const size_t per_call = ElementsPerCall(chunk_bytes, element_bytes);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(per_call, count - done);
    const size_t offset = done * element_bytes;
    if (src != dst) {
      std::memcpy(dst + offset, src + offset, n * element_bytes);
    }
    if (ffi::Error error = AllreduceChunk(dst + offset, n, dtype, op, comm);
        error.failure()) {
      return error;
    }
    done += n;
  }
  return ffi::Error::Success();
}

// The communicator from its Fortran handle (mpi4py's Comm.py2f()): one integer
// that means the same for MPICH (int handles) and Open MPI (pointer handles).
inline ffi::Error CommFromHandle(int64_t handle, MPI_Comm* comm) {
  *comm = MPI_Comm_f2c(static_cast<MPI_Fint>(handle));
  if (*comm == MPI_COMM_NULL) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: the communicator is MPI_COMM_NULL (was it "
        "freed after the function was compiled?)");
  }
  return ffi::Error::Success();
}

// What every platform's allreduce checks before it touches MPI: operand and
// result of one type and size, a type and an op MPI knows, MPI up, and the
// communicator. Fills in the MPI datatype, op and communicator.
inline ffi::Error CheckAllreduce(const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& y,
                                 int64_t comm_handle, int32_t op_code,
                                 MPI_Datatype* dtype, MPI_Op* op,
                                 MPI_Comm* comm) {
  if (x.element_type() != y.element_type() ||
      x.element_count() != y.element_count()) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: operand and result differ in type or size");
  }
  if (!DatatypeOf(x.element_type(), dtype)) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: MPI cannot reduce this element type (XLA "
        "type " +
        std::to_string(static_cast<int>(x.element_type())) + ")");
  }
  if (!OpFromCode(op_code, op)) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.allreduce: unknown op code " + std::to_string(op_code));
  }
  if (ffi::Error error = CheckMpiUsable(); error.failure()) return error;
  return CommFromHandle(comm_handle, comm);
}

// A token that exists once `x` does, for the MPI call after an allreduce. With
// it the allreduce returns its array alone: an (array, token) result would be a
// tuple, whose index table (16 bytes) XLA allocates as temp. No work, on any
// platform.
inline ffi::Error TokenAfterImpl(ffi::AnyBuffer, ffi::Result<ffi::Token>) {
  return ffi::Error::Success();
}

// The version of MPI these headers describe, for the import-time check.
inline std::string HeaderMpiLibrary() {
#if defined(OMPI_MAJOR_VERSION)
  return "Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
         std::to_string(OMPI_MINOR_VERSION) + "." +
         std::to_string(OMPI_RELEASE_VERSION);
#elif defined(I_MPI_VERSION)  // before MPICH: Intel's mpi.h defines both
  return std::string("Intel(R) MPI Library ") + I_MPI_VERSION;
#elif defined(MPICH_VERSION)
  return std::string("MPICH ") + MPICH_VERSION;
#else
  return "MPI " + std::to_string(MPI_VERSION) + "." +
         std::to_string(MPI_SUBVERSION);
#endif
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MPI_HELPERS_H_
