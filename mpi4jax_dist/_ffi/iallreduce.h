// The non-blocking allreduce (mpi4jax_dist.iallreduce, Request.test,
// Request.wait): a start posts MPI_Iallreduce (after the ranks' agreement
// check, where one is due) and returns at once; a test progresses it; a wait
// completes it and copies the result into XLA's buffer.

#ifndef MPI4JAX_DIST_FFI_IALLREDUCE_H_
#define MPI4JAX_DIST_FFI_IALLREDUCE_H_

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "allreduce.h"
#include "comm_registry.h"
#include "mpi_base.h"
#include "mpi_guard.h"
#include "request_table.h"
#include "stats.h"
#include "timeout.h"

namespace mpi4jax_dist {

// Post one MPI_Iallreduce of `count` elements in place; MPI_Iallreduce_c for
// counts above INT_MAX (the caller refuses those where the MPI has no MPI-4).
inline int PostIallreduce(void* data, size_t count, MPI_Datatype dtype,
                          MPI_Op op, MPI_Comm comm, MPI_Request* request) {
#if MPI4JAX_DIST_LARGE_COUNT
  if (count > static_cast<size_t>(INT_MAX)) {
    GetRequestStats().large_count_starts.fetch_add(1,
                                                   std::memory_order_relaxed);
    return MPI_Iallreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                            dtype, op, comm, request);
  }
#endif
  return MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype, op,
                        comm, request);
}

// The start: copy x into the slot's memory, post MPI_Iallreduce there and set
// *handle to the slot. Host memory. y, aliased with x, passes on to the test
// and the wait, which write the result into the buffer XLA gives them.
inline ffi::Error IallreduceStart(const ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                                  int64_t comm_id, int32_t op_code,
                                  Agreement agreement, int64_t uid,
                                  std::string_view site, int32_t* handle) {
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;
  // Not a blocking check: a start that only some ranks make would hang in it,
  // where it now fails at exit. The check is posted, and the reduction after
  // it (AdvanceDeferred).
  bool check = false;
  if (ffi::Error error = CheckAllreduce(x, y, comm_id, op_code,
                                        /*chunk_bytes=*/0, agreement, &dtype,
                                        &op, &comm, kIallreduceName, &check);
      error.failure()) {
    return error;
  }
  const size_t count = x.element_count();
  if (!MPI4JAX_DIST_LARGE_COUNT && count > static_cast<size_t>(INT_MAX)) {
    return ffi::Error::InvalidArgument(
        std::string(kIallreduceName) + ": " + std::to_string(count) +
        " elements are more than one MPI_Iallreduce takes (INT_MAX) on an MPI "
        "without MPI-4's MPI_Iallreduce_c, and one request cannot be split "
        "into chunks. Use mpi4jax_dist.allreduce, which reduces in chunks.");
  }
  auto post = [&](PendingRequest* slot) {
    if (check) {
      AgreementValues(count, x.element_type(), op_code, 0,
                      slot->agreement_mine);
      slot->deferred = true;
      slot->count = count;
      slot->dtype = dtype;
      slot->op = op;
      slot->comm = comm;
      return MPI_Iallreduce(slot->agreement_mine, slot->agreement_most,
                            kAgreementValues, MPI_INT64_T, MPI_MAX, comm,
                            &slot->agreement);
    }
    // Nothing to reduce: a null request.
    return count > 0 ? PostIallreduce(slot->data.get(), count, dtype, op, comm,
                                      &slot->request)
                     : MPI_SUCCESS;
  };
  int rc = MPI_SUCCESS;
  const int64_t posted_ns = SteadyNs();
  if (ffi::Error error =
          RequestTable::Get().Take(uid, site, x.untyped_data(), x.size_bytes(),
                                   posted_ns, post, &rc, handle);
      error.failure()) {
    return error;
  }
  if (rc != MPI_SUCCESS) {
    return MpiError(count > static_cast<size_t>(INT_MAX) ? "MPI_Iallreduce_c"
                                                         : "MPI_Iallreduce",
                    rc, kIallreduceName);
  }
  GetRequestStats().starts.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// A start that checks the ranks' agreement posts the check alone; its
// reduction is posted once the check has completed and agreed, in the first
// test that finds it complete, or in the wait. Posted together, a reduction of
// 1,000 floats on one rank and 2,000 on the other crashed Open MPI 5.0's
// libnbc inside MPI_Test (MPI_ERR_TRUNCATE, then a double free), before the
// wait could judge the check; MPICH reduced it silently. The price: the first
// start on a communicator (every one with MPI4JAX_DIST_DEBUG_CHECKS) hides
// little of its reduction. `block` waits for the check; else one MPI_Test.
// Disagreement is left in slot->disagreed, for the wait to report.
inline ffi::Error AdvanceDeferred(PendingRequest* slot, bool block,
                                  const char* who) {
  if (!slot->deferred) return ffi::Error::Success();
  int done = 1;
  int rc = MPI_SUCCESS;
  if (block) {
    rc = WaitRequest(&slot->agreement);
  } else {
    MpiGuard guard;
    rc = MPI_Test(&slot->agreement, &done, MPI_STATUS_IGNORE);
  }
  if (rc != MPI_SUCCESS) {
    return MpiError(
        block ? "MPI_Wait (agreement check)" : "MPI_Test (agreement check)", rc,
        who);
  }
  if (!done) return ffi::Error::Success();
  slot->deferred = false;
  if (AgreementVerdict(slot->agreement_mine, slot->agreement_most, who)
          .failure()) {
    slot->disagreed = true;
    return ffi::Error::Success();
  }
  if (slot->count == 0) return ffi::Error::Success();
  MpiGuard guard;
  const int posted = PostIallreduce(slot->data.get(), slot->count, slot->dtype,
                                    slot->op, slot->comm, &slot->request);
  if (posted != MPI_SUCCESS) {
    return MpiError(slot->count > static_cast<size_t>(INT_MAX)
                        ? "MPI_Iallreduce_c"
                        : "MPI_Iallreduce",
                    posted, who);
  }
  return ffi::Error::Success();
}

// The wait: complete the request of `handle` (MPI_Wait), copy its result into
// y, and free its slot.
inline ffi::Error IallreduceWait(ffi::AnyBuffer& y, int32_t handle) {
  const char* who = "mpi4jax_dist.Request.wait";
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  PendingRequest* slot = nullptr;
  if (ffi::Error error = RequestTable::Get().Find(handle, who, &slot);
      error.failure()) {
    return error;
  }
  // The deadline of a wait starts when it is entered (the start returned at
  // once); the call it names is the start's.
  EnterCall(who, slot->comm_id, slot->call);
  RequestStats& stats = GetRequestStats();
  stats.waits.fetch_add(1, std::memory_order_relaxed);
  const int64_t entered_ns = SteadyNs();
  stats.wait_slack_ns.fetch_add(entered_ns - slot->posted_ns,
                                std::memory_order_relaxed);
  if (ffi::Error error = AdvanceDeferred(slot, /*block=*/true, who);
      error.failure() || slot->disagreed) {
    if (error.success()) {
      error = AgreementVerdict(slot->agreement_mine, slot->agreement_most,
                               kIallreduceName);
    }
    RequestTable::Get().Free(slot);
    return error;
  }
  int done = 0;
  int rc = MPI_SUCCESS;
  {
    MpiGuard guard;
    rc = MPI_Test(&slot->request, &done, MPI_STATUS_IGNORE);
  }
  const int64_t tested_ns = SteadyNs();
  const bool complete = rc == MPI_SUCCESS && done;
  if (complete) {
    stats.done_before_wait.fetch_add(1, std::memory_order_relaxed);
  }
  if (rc == MPI_SUCCESS && !done) rc = WaitRequest(&slot->request);
  if (!complete) {
    stats.wait_blocked_ns.fetch_add(SteadyNs() - tested_ns,
                                    std::memory_order_relaxed);
  }
  if (rc != MPI_SUCCESS) {
    RequestTable::Get().Free(slot);
    return MpiError("MPI_Wait", rc, who);
  }
  if (y.size_bytes() != slot->bytes) {
    const std::string site = slot->site;
    const size_t bytes = slot->bytes;
    RequestTable::Get().Free(slot);
    return ffi::Error::Internal(std::string(who) + ": the request started at " +
                                site + " reduced " + std::to_string(bytes) +
                                " bytes, but its wait returns " +
                                std::to_string(y.size_bytes()));
  }
  if (slot->bytes > 0) {
    std::memcpy(y.untyped_data(), slot->data.get(), slot->bytes);
  }
  RequestTable::Get().Free(slot);
  return ffi::Error::Success();
}

// The test: one MPI_Test on the request of `handle`, so that MPI progresses it
// (the request stays pending for its wait either way).
inline ffi::Error IallreduceTest(int32_t handle) {
  const char* who = "mpi4jax_dist.Request.test";
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  PendingRequest* slot = nullptr;
  if (ffi::Error error = RequestTable::Get().Find(handle, who, &slot);
      error.failure()) {
    return error;
  }
  RequestStats& stats = GetRequestStats();
  stats.tests.fetch_add(1, std::memory_order_relaxed);
  if (ffi::Error error = AdvanceDeferred(slot, /*block=*/false, who);
      error.failure()) {
    return error;
  }
  int done = 0;
  int rc = MPI_SUCCESS;
  {
    MpiGuard guard;
    rc = MPI_Test(&slot->request, &done, MPI_STATUS_IGNORE);
  }
  if (rc != MPI_SUCCESS) return MpiError("MPI_Test", rc, who);
  if (done && !slot->deferred && !slot->disagreed) {
    stats.tests_done.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}

// Complete the pending requests of `handles` (all when empty) by polling
// MPI_Test for at most `timeout_s` seconds, and free those completed. For the
// Python side: an eager request dropped without its wait, and the requests
// still pending at exit. Returns the requests left pending (every one when MPI
// is no longer usable: nothing is called then).
inline std::vector<RequestTable::Info> CompletePending(
    const std::vector<int32_t>& handles, double timeout_s) {
  RequestTable& table = RequestTable::Get();
  std::vector<RequestTable::Info> wanted;
  for (const RequestTable::Info& info : table.Pending()) {
    if (handles.empty() || std::find(handles.begin(), handles.end(),
                                     info.handle) != handles.end()) {
      wanted.push_back(info);
    }
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return wanted;
  const double deadline = MPI_Wtime() + timeout_s;
  while (!wanted.empty()) {
    std::vector<RequestTable::Info> left;
    for (const RequestTable::Info& info : wanted) {
      PendingRequest* slot = nullptr;
      if (table.Find(info.handle, kIallreduceName, &slot).failure()) continue;
      int done = 0;
      MPI_Request both[2] = {slot->request, slot->agreement};
      int rc = MPI_SUCCESS;
      {
        MpiGuard guard;
        rc = MPI_Testall(2, both, &done, MPI_STATUSES_IGNORE);
      }
      slot->request = both[0];
      slot->agreement = both[1];
      if (rc != MPI_SUCCESS || done) {
        table.Free(slot);  // complete, or failed: MPI has no more use for it
      } else {
        left.push_back(info);
      }
    }
    wanted.swap(left);
    if (wanted.empty() || MPI_Wtime() > deadline) break;
  }
  return wanted;
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_IALLREDUCE_H_
