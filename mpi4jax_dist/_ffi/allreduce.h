// The blocking allreduce of host memory, in place and in chunks (at most
// chunk_bytes, and INT_MAX elements where the MPI has no MPI_Allreduce_c), and
// what every platform's handler checks before it touches MPI.

#ifndef MPI4JAX_DIST_FFI_ALLREDUCE_H_
#define MPI4JAX_DIST_FFI_ALLREDUCE_H_

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "comm_registry.h"
#include "mpi_base.h"
#include "op_dtype.h"
#include "stats.h"
#include "timeout.h"

namespace mpi4jax_dist {

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
  if (CurrentCall().deadline_ns != 0) {  // the collective timeout: polled
    MPI_Request request = MPI_REQUEST_NULL;
    int rc = MPI_SUCCESS;
    {
      MpiGuard guard;
#if MPI4JAX_DIST_ALLREDUCE_C
      if (count > static_cast<size_t>(INT_MAX)) {
        stats.large_count_calls.fetch_add(1, std::memory_order_relaxed);
        rc = MPI_Iallreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                              dtype, op, comm, &request);
      } else
#endif
        rc = MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype,
                            op, comm, &request);
    }
    return rc == MPI_SUCCESS ? WaitRequest(&request) : rc;
  }
  MpiGuard guard;
#if MPI4JAX_DIST_ALLREDUCE_C
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
#if !MPI4JAX_DIST_ALLREDUCE_C
  limit = std::min(limit, static_cast<size_t>(INT_MAX));
#endif
  return limit;
}

// One MPI reduction of `n` elements in place, its failure as an ffi::Error.
inline ffi::Error AllreduceChunk(void* data, size_t n, MPI_Datatype dtype,
                                 MPI_Op op, MPI_Comm comm) {
  const int rc = AllreduceOnce(data, n, dtype, op, comm);
  if (rc != MPI_SUCCESS) {
    return MpiError(MPI4JAX_DIST_ALLREDUCE_C && n > INT_MAX ? "MPI_Allreduce_c"
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

// What every platform's allreduce checks before it touches MPI: operand and
// result of one type and size, a type and an op MPI knows, MPI up, the
// communicator live, and the ranks' agreement when `agreement` says so
// (CheckAgreement, blocking). With `deferred` the caller checks the agreement
// itself (the non-blocking start posts it): *deferred then says whether to.
// Fills in the MPI datatype, op and communicator.
inline ffi::Error CheckAllreduce(const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& y, int64_t comm_id,
                                 int32_t op_code, int64_t chunk_bytes,
                                 Agreement agreement, MPI_Datatype* dtype,
                                 MPI_Op* op, MPI_Comm* comm,
                                 const char* who = kAllreduceName,
                                 bool* deferred = nullptr) {
  if (x.element_type() != y.element_type() ||
      x.element_count() != y.element_count()) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": operand and result differ in type or size");
  }
  if (!DatatypeOf(x.element_type(), dtype)) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": MPI cannot reduce this element type (XLA type " +
        std::to_string(static_cast<int>(x.element_type())) + ")");
  }
  if (!OpFromCode(op_code, op)) {
    return ffi::Error::InvalidArgument(std::string(who) + ": unknown op code " +
                                       std::to_string(op_code));
  }
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  bool first = false;
  if (ffi::Error error = CommFromId(comm_id, comm, &first, who);
      error.failure()) {
    return error;
  }
  EnterCall(who, comm_id, CommRegistry::Get().CountCall(comm_id));
  const bool check = agreement == Agreement::kEveryCall || first;
  if (deferred != nullptr) {
    *deferred = check;
  } else if (check) {
    return CheckAgreement(*comm, x.element_count(), x.element_type(), op_code,
                          chunk_bytes, who);
  }
  return ffi::Error::Success();
}

// A token that exists once `x` does, for the MPI call after an allreduce. With
// it the allreduce returns its array alone: an (array, token) result would be a
// tuple, whose index table (16 bytes) XLA allocates as temp. No work, on any
// platform.
inline ffi::Error TokenAfterImpl(ffi::AnyBuffer, ffi::Result<ffi::Token>) {
  return ffi::Error::Success();
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_ALLREDUCE_H_
