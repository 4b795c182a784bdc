// The blocking allreduce of host memory, in place and in chunks (at most
// chunk_bytes, and INT_MAX elements where the MPI has no MPI_Allreduce_c),
// checked against the other ranks' calls (agreement.h), and what every
// platform's handler does before it touches MPI (BeginCall).

#ifndef MPI4JAX_DIST_FFI_ALLREDUCE_H_
#define MPI4JAX_DIST_FFI_ALLREDUCE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "agreement.h"
#include "comm_registry.h"
#include "mpi_base.h"
#include "record.h"

namespace mpi4jax_dist {

// The largest number of elements one MPI call may take: `chunk_bytes` worth
// (0: no limit), and at most INT_MAX where the MPI has no large-count calls.
MPI4JAX_DIST_CORE_API size_t ElementsPerCall(int64_t chunk_bytes,
                                             size_t element_bytes);

// One blocking reduction of `n` elements in place (MPI_Allreduce, or
// MPI_Allreduce_c above INT_MAX elements where the MPI has it; under the
// collective timeout posted and polled), counted, its failure an ffi::Error.
MPI4JAX_DIST_CORE_API ffi::Error AllreduceChunk(void* data, size_t n,
                                                MPI_Datatype dtype, MPI_Op op,
                                                MPI_Comm comm);

// The header of a call whose payload goes apart from it (above
// CombinedLimit(), or from device memory): posted alone before the data and
// judged as soon as it completes, before the call returns (under Open MPI,
// before the data is posted: OneSizeFirst).
class MPI4JAX_DIST_CORE_API HeaderCheck {
 public:
  // Post it (nothing when `on` is false: the checks are off).
  ffi::Error Post(const CallHeader& header, MPI_Comm comm, bool on);

  // Whether it is posted and not yet judged.
  bool Pending() const { return posted_ && !judged_; }

  // Complete the payload's request `data` with it (CompleteJudged): where the
  // ranks disagree, *disagreed is set and `data` left pending.
  int CompleteWith(MPI_Request* data, bool* disagreed);

  // Complete it; whether the ranks agree (true where nothing was posted). The
  // MPI error of its completion, if any, in *rc.
  bool Agreed(int* rc);

 private:
  HeaderAlone message_;  // the header, padded where OneSizeFirst
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool posted_ = false;
  bool judged_ = false;
  int rc_ = MPI_SUCCESS;
};

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
// communicator is then refused: CommRegistry::Entry::broken_at).
MPI4JAX_DIST_CORE_API ffi::Error AllreduceChunked(
    const void* in, void* out, size_t count, size_t element_bytes,
    MPI_Datatype dtype, MPI_Op op, MPI_Comm comm, int64_t chunk_bytes,
    HeaderCheck* check = nullptr, bool* disagreed = nullptr);

// A call under way, from BeginCall to its end: what MPI reduces, on which of
// the package's communicators, the header the ranks compare, and its entry in
// the record.
struct MPI4JAX_DIST_CORE_API Call {
  const char* who = kAllreduceName;
  MPI_Datatype dtype = MPI_DATATYPE_NULL;
  MPI_Op op = MPI_OP_NULL;
  MPI_Comm comm = MPI_COMM_NULL;  // the private duplicate (comm_registry.h)
  CommRegistry::Entry* entry = nullptr;
  CallHeader header;
  int64_t site = 0;
  Record::Handle record;

  // The call ended (kDone) or failed (kFailed), in the record.
  void Finish(CallState state) const;

  // The call failed where the ranks disagree on it (or MPI failed on it,
  // `rc`): every rank's side explained in one report, on the communicator's
  // second duplicate, and the first refused from now on (a request of this
  // call may stay pending on it).
  ffi::Error Disagreed(int rc) const;
};

// A handler's call on a communicator, from after BeginCall (or a wait's or
// test's lookup) to its return: one at a time in a process. Programs that one
// thread dispatches run one after another on its device (PJRT), and the calls
// of one program in the order of their token, so two at once are calls of
// programs that nothing orders against each other: dispatched from several
// threads, or under several execution_stream_ids. Their calls may then meet
// the other ranks' in another order; the second fails instead (Crossed).
class MPI4JAX_DIST_CORE_API Turn {
 public:
  explicit Turn(CommRegistry::Entry* entry);
  ~Turn();
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;
  bool crossed() const { return crossed_; }

 private:
  CommRegistry::Entry* entry_;
  bool crossed_ = false;
};

// The error of a call made while another of this process ran on its
// communicator (Turn).
MPI4JAX_DIST_CORE_API ffi::Error Crossed(const char* who,
                                         const std::string& comm_name,
                                         int64_t seq);

// What every platform's allreduce checks and does before it touches the data:
// operand and result of one type and size, a type and an op MPI knows, MPI
// up, the communicator live; then the call counted, its deadline started, its
// entry written in the record, and the communicator's private duplicate made
// (waited for with `block`; *ready says whether it is there).
MPI4JAX_DIST_CORE_API ffi::Error BeginCall(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& y, int64_t comm_id,
    int32_t op_code, int64_t chunk_bytes, CallKind kind, int64_t site,
    bool block, Call* call, bool* ready, const char* who = kAllreduceName);

// The blocking allreduce of host memory from `in` into `out` (one buffer when
// XLA aliases them), checked against the other ranks' calls unless `checks` is
// off: up to CombinedLimit() (and one chunk) in one message with its header,
// above that beside it (HeaderCheck), or before it under Open MPI.
MPI4JAX_DIST_CORE_API ffi::Error AllreduceHost(const Call& call,
                                               const void* in, void* out,
                                               size_t count,
                                               size_t element_bytes,
                                               int64_t chunk_bytes,
                                               bool checks);

// A token that exists once `x` does, for the MPI call after an allreduce. With
// it the allreduce returns its array alone: an (array, token) result would be a
// tuple, whose index table (16 bytes) XLA allocates as temp. No work, on any
// platform.
MPI4JAX_DIST_CORE_API ffi::Error TokenAfterImpl(ffi::AnyBuffer,
                                                ffi::Result<ffi::Token>);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_ALLREDUCE_H_
