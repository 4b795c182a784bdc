// The non-blocking allreduce (iallreduce.h), in the core.

#include "iallreduce.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "agreement.h"
#include "allreduce.h"
#include "comm_registry.h"
#include "mpi_guard.h"
#include "record.h"
#include "stats.h"
#include "timeout.h"

namespace mpi4jax_dist {

namespace {

// Post one MPI_Iallreduce of `count` elements in place; MPI_Iallreduce_c for
// counts above INT_MAX (the caller refuses those where the MPI has no MPI-4).
int PostIallreduce(void* data, size_t count, MPI_Datatype dtype, MPI_Op op,
                   MPI_Comm comm, MPI_Request* request) {
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

// Post a slot's requests (the MPI lock held; the op and types made): the
// header and payload as one message, or the header apart and then the
// payload. An MPI return code.
int PostSlot(PendingRequest* slot) {
  slot->setup = false;
  const Call& call = slot->call;
  const size_t count = slot->count;
  if (slot->offset > 0) {  // one message
    CallHeader header = call.header;
    header.carried = static_cast<int64_t>(count);
    std::memcpy(slot->data.get(), &header, kHeaderBytes);
    return ReduceChecked(slot->data.get(), PaddedBytes(slot->bytes), call.comm,
                         &slot->request, /*guarded=*/true);
  }
  if (slot->checks) {
    slot->alone.header = call.header;
    slot->alone.header.carried = 0;
    const int rc =
        ReduceChecked(reinterpret_cast<char*>(&slot->alone), AlonePadBytes(),
                      call.comm, &slot->agreement, true);
    if (rc != MPI_SUCCESS) return rc;
    if (OneSizeFirst() && count > 0) {  // the payload once the ranks agree
      slot->deferred = true;
      return MPI_SUCCESS;
    }
  }
  // Nothing to reduce: a null request.
  return count > 0 ? PostIallreduce(slot->data.get(), count, call.dtype,
                                    call.op, call.comm, &slot->request)
                   : MPI_SUCCESS;
}

}  // namespace

// The start: copy x into the slot's memory, post MPI_Iallreduce there (behind
// its header where they go as one) and set *handle to the slot. Host memory.
// y, aliased with x, passes on to the test and the wait, which write the
// result into the buffer XLA gives them. The first start on a communicator
// posts nothing until its private duplicate is made (PrivateComm, not waited
// for here: a start that only some ranks make must not hang in it); the test
// or the wait posts then.
ffi::Error IallreduceStart(const ffi::AnyBuffer& x, ffi::AnyBuffer& y,
                           int64_t comm_id, int32_t op_code, bool checks,
                           int64_t uid, int64_t site, int32_t* handle) {
  Call call;
  bool ready = false;
  if (ffi::Error error =
          BeginCall(x, y, comm_id, op_code, /*chunk_bytes=*/0, kNonBlocking,
                    site, /*block=*/false, &call, &ready, kIallreduceName);
      error.failure()) {
    return error;
  }
  Turn turn(call.entry);
  if (turn.crossed()) {
    call.Finish(kFailed);
    return Crossed(kIallreduceName, call.entry->name, call.header.seq);
  }
  const size_t count = x.element_count();
  if (!MPI4JAX_DIST_LARGE_COUNT && count > static_cast<size_t>(INT_MAX)) {
    call.Finish(kFailed);
    return ffi::Error::InvalidArgument(
        std::string(kIallreduceName) + ": " + std::to_string(count) +
        " elements are more than one MPI_Iallreduce takes (INT_MAX) on an MPI "
        "without MPI-4's MPI_Iallreduce_c, and one request cannot be split "
        "into chunks. Use mpi4jax_dist.allreduce, which reduces in chunks.");
  }
  const size_t bytes = x.size_bytes();
  const bool combined = checks && bytes <= CombinedLimit();
  // Made before the locks Take holds.
  CheckedType(combined ? PaddedBytes(bytes) : AlonePadBytes());
  CheckedOp();
  auto post = [&](PendingRequest* slot) {
    slot->call = call;
    slot->count = count;
    slot->checks = checks;
    slot->bytes = bytes;
    if (!ready) {
      slot->setup = true;
      return MPI_SUCCESS;
    }
    return PostSlot(slot);
  };
  int rc = MPI_SUCCESS;
  const int64_t posted_ns = SteadyNs();
  if (ffi::Error error = RequestTable::Get().Take(
          uid, Record::Get().Site(site), x.untyped_data(), bytes,
          combined ? kHeaderBytes : 0, combined ? PaddedBytes(bytes) - bytes : 0,
          posted_ns, post, &rc, handle);
      error.failure()) {
    call.Finish(kFailed);
    return error;
  }
  if (rc != MPI_SUCCESS) {
    call.Finish(kFailed);
    return MpiError(count > static_cast<size_t>(INT_MAX) ? "MPI_Iallreduce_c"
                                                         : "MPI_Iallreduce",
                    rc, kIallreduceName);
  }
  GetRequestStats().starts.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

namespace {

// A slot whose first start found the private duplicate not yet made: post it
// once the duplicate is there (waited for with `block`).
ffi::Error PostWhenReady(PendingRequest* slot, bool block, const char* who) {
  if (!slot->setup) return ffi::Error::Success();
  MPI_Comm dup = MPI_COMM_NULL;
  bool ready = false;
  if (ffi::Error error =
          PrivateComm(*slot->call.entry, block, &dup, &ready, who);
      error.failure() || !ready) {
    return error;
  }
  slot->call.comm = dup;
  MpiGuard guard;
  const int rc = PostSlot(slot);
  if (rc != MPI_SUCCESS) return MpiError("MPI_Iallreduce", rc, who);
  return ffi::Error::Success();
}

// A slot whose payload waits for its header (OneSizeFirst): post the payload
// once the header has completed (waited for with `block`) and says that the
// ranks agree. Where it says otherwise, or failed, nothing more is posted and
// *header_rc holds the header's MPI error. An MPI return code.
int PostDeferred(PendingRequest* slot, bool block, int* header_rc) {
  *header_rc = MPI_SUCCESS;
  if (!slot->deferred) return MPI_SUCCESS;
  if (slot->agreement != MPI_REQUEST_NULL) {
    int done = 1;
    int rc = MPI_SUCCESS;
    if (block) {
      rc = WaitRequest(&slot->agreement, kHeaderBytes);
    } else {
      MpiGuard guard;
      rc = MPI_Test(&slot->agreement, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) slot->header_rc = rc;
    if (rc == MPI_SUCCESS && !done) return MPI_SUCCESS;
  }
  *header_rc = slot->header_rc;
  if (*header_rc != MPI_SUCCESS || slot->alone.header.flags != 0) {
    return MPI_SUCCESS;
  }
  slot->deferred = false;
  MpiGuard guard;
  return PostIallreduce(slot->data.get(), slot->count, slot->call.dtype,
                        slot->call.op, slot->call.comm, &slot->request);
}

}  // namespace

// The wait: complete the request of `handle` (MPI_Wait), judge its header,
// copy its result into y, and free its slot.
ffi::Error IallreduceWait(ffi::AnyBuffer& y, int32_t handle) {
  const char* who = "mpi4jax_dist.Request.wait";
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  PendingRequest* slot = nullptr;
  if (ffi::Error error = RequestTable::Get().Find(handle, who, &slot);
      error.failure()) {
    return error;
  }
  // The deadline of a wait starts when it is entered (the start returned at
  // once); the call it names is the start's, which the record now says this
  // rank waits in.
  EnterCall(who, slot->comm_id, slot->seq);
  Record::Waiting(slot->call.record);
  Turn turn(slot->call.entry);
  if (turn.crossed()) {
    slot->call.Finish(kFailed);
    const std::string name = slot->call.entry->name;
    const int64_t seq = slot->seq;
    RequestTable::Get().Abandon(slot);  // its request may stay pending in MPI
    return Crossed(who, name, seq);
  }
  RequestStats& stats = GetRequestStats();
  stats.waits.fetch_add(1, std::memory_order_relaxed);
  const int64_t entered_ns = SteadyNs();
  stats.wait_slack_ns.fetch_add(entered_ns - slot->posted_ns,
                                std::memory_order_relaxed);
  if (ffi::Error error = PostWhenReady(slot, /*block=*/true, who);
      error.failure()) {
    slot->call.Finish(kFailed);
    RequestTable::Get().Free(slot);
    return error;
  }
  int header_rc = MPI_SUCCESS;
  int rc = PostDeferred(slot, /*block=*/true, &header_rc);
  if (rc != MPI_SUCCESS) {
    slot->call.Finish(kFailed);
    RequestTable::Get().Free(slot);
    return MpiError("MPI_Iallreduce", rc, who);
  }
  if (slot->deferred) {  // the ranks disagree: no payload was posted
    const Call call = slot->call;
    RequestTable::Get().Free(slot);
    return call.Disagreed(header_rc);
  }
  int done = 0;
  {
    MpiGuard guard;
    rc = MPI_Test(&slot->request, &done, MPI_STATUS_IGNORE);
  }
  const int64_t tested_ns = SteadyNs();
  const bool complete = rc == MPI_SUCCESS && done;
  if (complete) {
    stats.done_before_wait.fetch_add(1, std::memory_order_relaxed);
  }
  // The header, in front of the payload or apart: apart, it is judged as soon
  // as it completes, and where the ranks disagree the payload's request may
  // never complete (CompleteJudged).
  bool abandoned = false;
  if (rc == MPI_SUCCESS && !done) {
    rc = CompleteJudged(&slot->agreement, slot->alone.header, &slot->request,
                        &header_rc, &abandoned);
    abandoned = abandoned && slot->request != MPI_REQUEST_NULL;
  } else if (slot->agreement != MPI_REQUEST_NULL) {
    header_rc = WaitRequest(&slot->agreement, kHeaderBytes);
  }
  if (!complete) {
    stats.wait_blocked_ns.fetch_add(SteadyNs() - tested_ns,
                                    std::memory_order_relaxed);
  }
  CallHeader header = slot->alone.header;
  if (slot->offset > 0) std::memcpy(&header, slot->data.get(), kHeaderBytes);
  const bool checked = slot->checks;
  if (checked && (rc != MPI_SUCCESS || header_rc != MPI_SUCCESS ||
                  header.flags != 0)) {
    const Call call = slot->call;
    if (abandoned) {
      RequestTable::Get().Abandon(slot);
    } else {
      RequestTable::Get().Free(slot);
    }
    return call.Disagreed(rc != MPI_SUCCESS ? rc : header_rc);
  }
  if (rc != MPI_SUCCESS) {
    slot->call.Finish(kFailed);
    RequestTable::Get().Free(slot);
    return MpiError("MPI_Wait", rc, who);
  }
  if (y.size_bytes() != slot->bytes) {
    const std::string site = slot->site;
    const size_t bytes = slot->bytes;
    slot->call.Finish(kFailed);
    RequestTable::Get().Free(slot);
    return ffi::Error::Internal(std::string(who) + ": the request started at " +
                                site + " reduced " + std::to_string(bytes) +
                                " bytes, but its wait returns " +
                                std::to_string(y.size_bytes()));
  }
  if (slot->bytes > 0) {
    std::memcpy(y.untyped_data(), slot->data.get() + slot->offset, slot->bytes);
  }
  slot->call.Finish(kDone);
  RequestTable::Get().Free(slot);
  return ffi::Error::Success();
}

// The test: one MPI_Test on the request of `handle` (and its header), so that
// MPI progresses it (the request stays pending for its wait either way).
ffi::Error IallreduceTest(int32_t handle) {
  const char* who = "mpi4jax_dist.Request.test";
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  PendingRequest* slot = nullptr;
  if (ffi::Error error = RequestTable::Get().Find(handle, who, &slot);
      error.failure()) {
    return error;
  }
  RequestStats& stats = GetRequestStats();
  stats.tests.fetch_add(1, std::memory_order_relaxed);
  if (ffi::Error error = PostWhenReady(slot, /*block=*/false, who);
      error.failure()) {
    return error;
  }
  if (slot->setup) return ffi::Error::Success();
  int header_rc = MPI_SUCCESS;
  int rc = PostDeferred(slot, /*block=*/false, &header_rc);
  if (rc != MPI_SUCCESS) return MpiError("MPI_Iallreduce", rc, who);
  // The payload waits for the header; a disagreement is the wait's to report.
  if (slot->deferred) return ffi::Error::Success();
  int done = 0;
  {
    MpiGuard guard;
    if (slot->agreement != MPI_REQUEST_NULL) {
      int header_done = 0;
      rc = MPI_Test(&slot->agreement, &header_done, MPI_STATUS_IGNORE);
    }
    if (rc == MPI_SUCCESS) {
      rc = MPI_Test(&slot->request, &done, MPI_STATUS_IGNORE);
    }
  }
  if (rc != MPI_SUCCESS) return MpiError("MPI_Test", rc, who);
  if (done) stats.tests_done.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// Complete the pending requests of `handles` (all when empty) by polling
// MPI_Test for at most `timeout_s` seconds, and free those completed. For the
// Python side: an eager request dropped without its wait, and the requests
// still pending at exit. Returns the requests left pending (every one when MPI
// is no longer usable: nothing is called then).
std::vector<RequestTable::Info> CompletePending(
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
      if (slot->setup) {
        // Nothing posted: once the duplicate is made, MPI holds nothing of it.
        MPI_Comm dup = MPI_COMM_NULL;
        bool ready = false;
        PrivateComm(*slot->call.entry, false, &dup, &ready, kIallreduceName);
        if (ready) {
          table.Free(slot);
        } else {
          left.push_back(info);
        }
        continue;
      }
      // A payload waiting for its header is posted once the ranks agree: the
      // other ranks may be waiting for it.
      int header_rc = MPI_SUCCESS;
      if (PostDeferred(slot, /*block=*/false, &header_rc) != MPI_SUCCESS) {
        table.Free(slot);  // failed: MPI has no more use for it
        continue;
      }
      if (slot->deferred) {
        if (slot->agreement == MPI_REQUEST_NULL) {
          table.Free(slot);  // the ranks disagree: nothing more to post
        } else {
          left.push_back(info);  // its header still pending
        }
        continue;
      }
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
