// The non-blocking allreduce (mpi4jax_dist.iallreduce, Request.test,
// Request.wait): a start posts MPI_Iallreduce (with its header, agreement.h)
// and returns at once; a test progresses it; a wait completes it, judges the
// header and copies the result into XLA's buffer.

#ifndef MPI4JAX_DIST_FFI_IALLREDUCE_H_
#define MPI4JAX_DIST_FFI_IALLREDUCE_H_

#include <cstdint>
#include <vector>

#include "mpi_base.h"
#include "request_table.h"

namespace mpi4jax_dist {

// The start: copy x into the slot's memory, post MPI_Iallreduce there (behind
// its header where they go as one) and set *handle to the slot. Host memory.
// y, aliased with x, passes on to the test and the wait, which write the
// result into the buffer XLA gives them. The first start on a communicator
// posts nothing until its private duplicate is made (PrivateComm, not waited
// for here: a start that only some ranks make must not hang in it); the test
// or the wait posts then.
MPI4JAX_DIST_CORE_API ffi::Error IallreduceStart(const ffi::AnyBuffer& x,
                                                 ffi::AnyBuffer& y,
                                                 int64_t comm_id,
                                                 int32_t op_code, bool checks,
                                                 int64_t uid, int64_t site,
                                                 int32_t* handle);

// The wait: complete the request of `handle` (MPI_Wait), judge its header,
// copy its result into y, and free its slot.
MPI4JAX_DIST_CORE_API ffi::Error IallreduceWait(ffi::AnyBuffer& y,
                                                int32_t handle);

// The test: one MPI_Test on the request of `handle` (and its header), so that
// MPI progresses it (the request stays pending for its wait either way).
MPI4JAX_DIST_CORE_API ffi::Error IallreduceTest(int32_t handle);

// Complete the pending requests of `handles` (all when empty) by polling
// MPI_Test for at most `timeout_s` seconds, and free those completed. For the
// Python side: an eager request dropped without its wait, and the requests
// still pending at exit. Returns the requests left pending (every one when MPI
// is no longer usable: nothing is called then).
MPI4JAX_DIST_CORE_API std::vector<RequestTable::Info> CompletePending(
    const std::vector<int32_t>& handles, double timeout_s);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_IALLREDUCE_H_
