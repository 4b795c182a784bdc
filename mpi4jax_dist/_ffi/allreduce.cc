// The blocking allreduce of host memory and what every platform's handler does
// before it touches MPI (allreduce.h), in the core.

#include "allreduce.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "mpi_guard.h"
#include "op_dtype.h"
#include "stats.h"
#include "timeout.h"

namespace mpi4jax_dist {

namespace {

// Count one MPI reduction of `count` elements (stats.h).
void CountMpiCall(size_t count) {
  Stats& stats = GetStats();
  stats.mpi_calls.fetch_add(1, std::memory_order_relaxed);
  int64_t seen = stats.max_call_count.load(std::memory_order_relaxed);
  while (static_cast<int64_t>(count) > seen &&
         !stats.max_call_count.compare_exchange_weak(
             seen, static_cast<int64_t>(count), std::memory_order_relaxed)) {
  }
}

// Post one MPI allreduce of `count` elements in place (MPI_Iallreduce, or
// MPI_Iallreduce_c above INT_MAX elements where the MPI has it).
int PostAllreduce(void* data, size_t count, MPI_Datatype dtype, MPI_Op op,
                  MPI_Comm comm, MPI_Request* request) {
  MpiGuard guard;
#if MPI4JAX_DIST_ALLREDUCE_C
  if (count > static_cast<size_t>(INT_MAX)) {
    GetStats().large_count_calls.fetch_add(1, std::memory_order_relaxed);
    return MPI_Iallreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                            dtype, op, comm, request);
  }
#endif
  return MPI_Iallreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype, op,
                        comm, request);
}

// One MPI allreduce of `count` elements in place (sendbuf MPI_IN_PLACE):
// blocking, or under the collective timeout posted and polled.
int AllreduceOnce(void* data, size_t count, MPI_Datatype dtype, MPI_Op op,
                  MPI_Comm comm) {
  CountMpiCall(count);
  if (CurrentCall().deadline_ns != 0) {  // the collective timeout: polled
    MPI_Request request = MPI_REQUEST_NULL;
    const int rc = PostAllreduce(data, count, dtype, op, comm, &request);
    int size = 0;
    MPI_Type_size(dtype, &size);
    return rc == MPI_SUCCESS ? WaitRequest(&request, count * size) : rc;
  }
  MpiGuard guard;
#if MPI4JAX_DIST_ALLREDUCE_C
  if (count > static_cast<size_t>(INT_MAX)) {
    GetStats().large_count_calls.fetch_add(1, std::memory_order_relaxed);
    return MPI_Allreduce_c(MPI_IN_PLACE, data, static_cast<MPI_Count>(count),
                           dtype, op, comm);
  }
#endif
  return MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(count), dtype, op,
                       comm);
}

// The largest number of elements one MPI call may take: `chunk_bytes` worth
// (0: no limit), and at most INT_MAX where the MPI has no large-count calls.
}  // namespace

size_t ElementsPerCall(int64_t chunk_bytes, size_t element_bytes) {
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

// An MPI error of a reduction of `n` elements as an ffi::Error.
namespace {

ffi::Error AllreduceError(size_t n, int rc) {
  return MpiError(MPI4JAX_DIST_ALLREDUCE_C && n > INT_MAX ? "MPI_Allreduce_c"
                                                          : "MPI_Allreduce",
                  rc);
}

}  // namespace

// One blocking reduction of `n` elements in place, its failure an ffi::Error.
ffi::Error AllreduceChunk(void* data, size_t n, MPI_Datatype dtype, MPI_Op op,
                          MPI_Comm comm) {
  const int rc = AllreduceOnce(data, n, dtype, op, comm);
  return rc == MPI_SUCCESS ? ffi::Error::Success() : AllreduceError(n, rc);
}

ffi::Error HeaderCheck::Post(const CallHeader& header, MPI_Comm comm,
                             bool on) {
  if (!on) return ffi::Error::Success();
  message_.header = header;
  message_.header.carried = 0;
  const int rc = ReduceChecked(reinterpret_cast<char*>(&message_),
                               AlonePadBytes(), comm, &request_);
  if (rc != MPI_SUCCESS) {
    request_ = MPI_REQUEST_NULL;
    return MpiError("MPI_Iallreduce (the call's header)", rc);
  }
  posted_ = true;
  return ffi::Error::Success();
}

int HeaderCheck::CompleteWith(MPI_Request* data, bool* disagreed) {
  if (!Pending()) {
    *disagreed = false;
    return WaitRequest(data);
  }
  const int rc =
      CompleteJudged(&request_, message_.header, data, &rc_, disagreed);
  judged_ = true;
  return rc;
}

bool HeaderCheck::Agreed(int* rc) {
  *rc = MPI_SUCCESS;
  if (!posted_) return true;
  if (!judged_) {
    rc_ = WaitRequest(&request_, kHeaderBytes);
    judged_ = true;
  }
  *rc = rc_;
  return rc_ == MPI_SUCCESS && message_.header.flags == 0;
}

// Allreduce `count` elements of host memory from `in` into `out`, chunk by
// chunk so that MPI's scratch memory is bounded by one chunk.
//
// The MPI standard asks for MPI_IN_PLACE on all ranks or none; every rank
// passes it here. When XLA gives two buffers, each chunk is first copied to
// the result and then reduced in place there. With `check`, the first chunk
// is posted non-blocking and completed with the header, judged as soon as it
// completes: ranks that disagree (on the count, say, or whether the payload
// goes apart) never block in a reduction the others do not match; *disagreed
// then says so, and that chunk's request stays pending in MPI (the
// communicator is then refused: CommRegistry::Entry::broken).
ffi::Error AllreduceChunked(const void* in, void* out, size_t count,
                            size_t element_bytes, MPI_Datatype dtype, MPI_Op op,
                            MPI_Comm comm, int64_t chunk_bytes,
                            HeaderCheck* check, bool* disagreed) {
  const size_t per_call = ElementsPerCall(chunk_bytes, element_bytes);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(per_call, count - done);
    const size_t offset = done * element_bytes;
    if (src != dst) {
      std::memcpy(dst + offset, src + offset, n * element_bytes);
    }
    if (check != nullptr && check->Pending()) {
      CountMpiCall(n);
      MPI_Request request = MPI_REQUEST_NULL;
      int rc = PostAllreduce(dst + offset, n, dtype, op, comm, &request);
      if (rc != MPI_SUCCESS) return AllreduceError(n, rc);
      rc = check->CompleteWith(&request, disagreed);
      if (*disagreed) return ffi::Error::Success();
      if (rc != MPI_SUCCESS) return AllreduceError(n, rc);
    } else if (ffi::Error error = AllreduceChunk(dst + offset, n, dtype, op, comm);
               error.failure()) {
      return error;
    }
    done += n;
  }
  return ffi::Error::Success();
}

void Call::Finish(CallState state) const { Record::Finish(record, state); }

ffi::Error Call::Disagreed(int rc) const {
  Finish(kFailed);
  int64_t none = 0;
  entry->broken_at.compare_exchange_strong(none, header.seq);
  return Explain(entry->explain, header, Record::Get().Site(site), who,
                 entry->name, rc);
}

Turn::Turn(CommRegistry::Entry* entry) : entry_(entry) {
  crossed_ = entry_->active.fetch_add(1, std::memory_order_acq_rel) != 0;
}

Turn::~Turn() { entry_->active.fetch_sub(1, std::memory_order_acq_rel); }

// The error of a call made while another of this process ran on its
// communicator (Turn).
ffi::Error Crossed(const char* who, const std::string& comm_name,
                   int64_t seq) {
  return ffi::Error(
      ffi::ErrorCode::kFailedPrecondition,
      std::string(who) + ": call #" + std::to_string(seq) + " on " + comm_name +
          " ran while another program of this process ran a call there: "
          "programs dispatched from several threads (or under several "
          "execution_stream_ids) are not ordered against each other, so the "
          "ranks may meet their calls in different orders and reduce one "
          "call's data with another's. Dispatch the programs that hold "
          "mpi4jax_dist's calls from one thread, or let one thread wait for "
          "its program (block_until_ready) before another dispatches.");
}

// What every platform's allreduce checks and does before it touches the data:
// operand and result of one type and size, a type and an op MPI knows, MPI
// up, the communicator live; then the call counted, its deadline started, its
// entry written in the record, and the communicator's private duplicate made
// (waited for with `block`; *ready says whether it is there).
ffi::Error BeginCall(const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                     int64_t comm_id, int32_t op_code, int64_t chunk_bytes,
                     CallKind kind, int64_t site, bool block, Call* call,
                     bool* ready, const char* who) {
  call->who = who;
  if (x.element_type() != y.element_type() ||
      x.element_count() != y.element_count()) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": operand and result differ in type or size");
  }
  if (!DatatypeOf(x.element_type(), &call->dtype)) {
    return ffi::Error::InvalidArgument(
        std::string(who) + ": MPI cannot reduce this element type (XLA type " +
        std::to_string(static_cast<int>(x.element_type())) + ")");
  }
  if (!OpFromCode(op_code, &call->op)) {
    return ffi::Error::InvalidArgument(std::string(who) + ": unknown op code " +
                                       std::to_string(op_code));
  }
  if (ffi::Error error = CheckMpiUsable(who); error.failure()) return error;
  if (ffi::Error error = CommRegistry::Get().Find(comm_id, &call->entry, who);
      error.failure()) {
    return error;
  }
  if (const int64_t at = call->entry->broken_at.load(); at != 0) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(who) + ": the ranks of " + call->entry->name +
            " disagreed on its call #" + std::to_string(at) +
            ", and MPI may still hold a request of that call: no later call "
            "may use it. Make the ranks agree (that call's error says where "
            "they differ), or call with another communicator.");
  }
  const int64_t seq = CommRegistry::Get().CountCall(comm_id);
  EnterCall(who, comm_id, seq);
  CallHeader& h = call->header;
  h.version = kHeaderVersion;
  h.kind = kind;
  h.op = op_code;
  h.type = static_cast<int32_t>(x.element_type());
  h.count = static_cast<int64_t>(x.element_count());
  h.carried = 0;
  h.chunk_bytes = chunk_bytes;
  h.seq = seq;
  h.site_key = Record::Get().Key(site);
  call->site = site;
  // A non-blocking start is posted, not waited in, until its wait.
  call->record = Record::Get().Enter(
      comm_id, seq, kind, op_code, h.type, h.count, site, SteadyNs(),
      call->entry->name.c_str(), kind == kNonBlocking ? kPosted : kEntered);
  if (ffi::Error error =
          PrivateComm(*call->entry, block, &call->comm, ready, who);
      error.failure()) {
    call->Finish(kFailed);
    return error;
  }
  return ffi::Error::Success();
}

// The blocking allreduce of host memory from `in` into `out` (one buffer when
// XLA aliases them), checked against the other ranks' calls unless `checks` is
// off: up to CombinedLimit() (and one chunk) in one message with its header,
// above that beside it (HeaderCheck), or before it under Open MPI.
ffi::Error AllreduceHost(const Call& call, const void* in, void* out,
                         size_t count, size_t element_bytes,
                         int64_t chunk_bytes, bool checks) {
  const size_t bytes = count * element_bytes;
  if (checks && bytes <= CombinedLimit() &&
      (chunk_bytes <= 0 || bytes <= static_cast<size_t>(chunk_bytes))) {
    // The smallest messages (all of one size: PaddedBytes) go as a blocking
    // MPI_Allreduce, the fastest; larger ones, and all under the collective
    // timeout, as MPI_Iallreduce and its wait, which MPI completes whatever
    // size the other ranks send (MPICH 5's blocking MPI_Allreduce ends the
    // job then), so that the header can say that they disagree.
    const size_t padded = PaddedBytes(bytes);
    const bool blocking =
        padded == PaddedBytes(0) && CurrentCall().deadline_ns == 0;
    char* buffer = Scratch();
    CallHeader header = call.header;
    header.carried = static_cast<int64_t>(count);
    std::memcpy(buffer, &header, kHeaderBytes);
    if (bytes > 0) std::memcpy(buffer + kHeaderBytes, in, bytes);
    CountMpiCall(count);
    int rc = MPI_SUCCESS;
    if (blocking) {
      rc = ReduceChecked(buffer, padded, call.comm, nullptr);
    } else {
      MPI_Request request = MPI_REQUEST_NULL;
      rc = ReduceChecked(buffer, padded, call.comm, &request);
      if (rc == MPI_SUCCESS) rc = WaitRequest(&request, padded);
    }
    std::memcpy(&header, buffer, kHeaderBytes);
    if (rc != MPI_SUCCESS || header.flags != 0) return call.Disagreed(rc);
    if (bytes > 0) std::memcpy(out, buffer + kHeaderBytes, bytes);
    call.Finish(kDone);
    return ffi::Error::Success();
  }
  HeaderCheck check;
  if (ffi::Error error = check.Post(call.header, call.comm, checks);
      error.failure()) {
    call.Finish(kFailed);
    return error;
  }
  bool disagreed = false;
  int rc = MPI_SUCCESS;
  // Under Open MPI no payload goes before the ranks agree (OneSizeFirst).
  if (OneSizeFirst() && !check.Agreed(&rc)) return call.Disagreed(rc);
  ffi::Error error =
      count == 0 ? ffi::Error::Success()
                 : AllreduceChunked(in, out, count, element_bytes, call.dtype,
                                    call.op, call.comm, chunk_bytes, &check,
                                    &disagreed);
  if (disagreed || !check.Agreed(&rc)) return call.Disagreed(rc);
  call.Finish(error.success() ? kDone : kFailed);
  return error;
}

// A token that exists once `x` does, for the MPI call after an allreduce. With
// it the allreduce returns its array alone: an (array, token) result would be a
// tuple, whose index table (16 bytes) XLA allocates as temp. No work, on any
// platform.
ffi::Error TokenAfterImpl(ffi::AnyBuffer, ffi::Result<ffi::Token>) {
  return ffi::Error::Success();
}

}  // namespace mpi4jax_dist
