// The non-blocking allreduce's requests in flight, between a start and its
// wait: each holds a slot and the memory MPI reduces into (never XLA's buffer,
// which XLA may free while MPI still writes), and XLA carries its handle, an
// int32, from the start to the test and the wait.

#ifndef MPI4JAX_DIST_FFI_REQUEST_TABLE_H_
#define MPI4JAX_DIST_FFI_REQUEST_TABLE_H_

#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "agreement.h"
#include "allreduce.h"
#include "mpi_base.h"

namespace mpi4jax_dist {

constexpr const char* kIallreduceName = "mpi4jax_dist.iallreduce";

// One request in flight.
struct PendingRequest {
  // The reduction (with its header in front of the payload, `offset` bytes,
  // where they go as one message), and the header posted apart where they do
  // not (`agreement`; MPI_REQUEST_NULL where there is none).
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Request agreement = MPI_REQUEST_NULL;
  HeaderAlone alone;  // the header posted apart, reduced in place
  size_t offset = 0;  // kHeaderBytes (header and payload as one) or 0
  bool checks = true;
  // The payload waits for the header apart to agree (OneSizeFirst): the test
  // or the wait that finds it agreed posts it.
  bool deferred = false;
  int header_rc = MPI_SUCCESS;  // the header's MPI error, where it failed
  // Nothing posted yet: the communicator's private duplicate is still being
  // made (its first call); the test or the wait posts once it is there.
  bool setup = false;
  // The call as BeginCall set it up (its header, communicator, record entry).
  Call call;
  size_t count = 0;
  // The memory MPI reduces into, owned here (see above), and the message's
  // size; capacity is what `data` holds, kept between requests when small.
  std::unique_ptr<char[]> data;
  size_t capacity = 0;
  size_t bytes = 0;
  // The start op's id from tracing (0: an eager start, not checked), and where
  // in Python it was made, for the messages.
  int64_t uid = 0;
  std::string site;
  // The communicator's id and the start's number among its calls (see
  // CallContext), for a wait that times out.
  int64_t comm_id = 0;
  int64_t seq = 0;
  // When the start posted it (steady clock, ns; see SteadyNs).
  int64_t posted_ns = 0;
  int32_t generation = 0;
  bool active = false;
};

// The requests in flight. A handle is generation * kMaxRequests + slot index,
// so that a handle whose slot was freed and taken again (a wait run twice, a
// handle from an earlier run) is refused rather than taken for another request.
// Slots are never moved (unique_ptr), so a handler may use its slot outside the
// lock: data dependencies order the start, tests and wait of one request.
class MPI4JAX_DIST_CORE_API RequestTable {
 public:
  static constexpr int32_t kMaxRequests = 4096;
  static constexpr int32_t kMaxGeneration = INT32_MAX / kMaxRequests - 1;
  // A completed slot keeps at most this much memory for its next request (a
  // fresh allocation each time costs its page faults: for 64 MiB, as much as
  // the two copies).
  static constexpr size_t kKeepBytes = size_t{64} << 20;

  struct Info {
    int32_t handle;
    int64_t uid;
    std::string site;
  };

  // The process's table, the core's. Never destroyed: a request still
  // pending at exit keeps its memory until the process ends, whatever runs
  // after static destructors.
  static RequestTable& Get();

  // Take a slot for a start (op `uid`, made at `site`) of `bytes`, copy them
  // from `operand` into the slot's memory, `offset` bytes in (room for a
  // header) and with `padding` bytes after them, and post its requests with
  // `post(slot)` (an MPI return code) under the table's lock and the MPI
  // lock, so that no one finds the slot half made. Refused when that start's
  // previous request is still pending (its wait did not run), or when
  // kMaxRequests are; the slot is freed again when `post` fails.
  ffi::Error Take(int64_t uid, std::string_view site, const void* operand,
                  size_t bytes, size_t offset, size_t padding,
                  int64_t posted_ns,
                  const std::function<int(PendingRequest*)>& post, int* rc,
                  int32_t* handle);

  // The pending request of `handle`, or an error naming what is wrong.
  ffi::Error Find(int32_t handle, const char* who, PendingRequest** slot);

  // Free the slot of a completed request (MPI is done with its memory).
  void Free(PendingRequest* slot);

  // Free a slot whose request stays pending in MPI (its ranks disagreed, so
  // it may never complete): its memory is left to MPI for good, not reused.
  void Abandon(PendingRequest* slot);

  // The requests in flight, as (handle, uid, site).
  std::vector<Info> Pending();

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<PendingRequest>> slots_;
  int64_t active_ = 0;
};

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_REQUEST_TABLE_H_
