// Every call checked against its peers before it returns a value: the ranks of
// a communicator must make the same calls in the same order (the same kind,
// op, element type and count, made at the same line of the user's code or
// under the same name), and a call they disagree on fails on every rank
// with one report naming each side, instead of returning wrong numbers.
//
// How, at no cost a benchmark sees (docs/faults.rst, *Ranks that disagree*):
// each call carries a header (CallHeader) that MPI reduces with a reduction
// op of ours (CheckedOp), which compares the headers it combines and marks
// the result where they differ.
// - Up to kCombinedBytes of payload, header and payload travel as one message
//   of one MPI datatype: one collective, as without the check.
// - Above it, the header goes alone, posted non-blocking before the data and
//   completed while the data is reduced; it is judged after the first chunk
//   and before the call returns (under Open MPI, before the data is posted:
//   OneSizeFirst).
// A disagreement is then explained (Explain): each rank's call and where the
// user made it, gathered once to the communicator's rank 0, which words one
// report that every rank raises alike.

#ifndef MPI4JAX_DIST_FFI_AGREEMENT_H_
#define MPI4JAX_DIST_FFI_AGREEMENT_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "mpi_base.h"

namespace mpi4jax_dist {

// What a rank says of its call. The fields but `flags` and `reserved` must
// be alike on every rank; `flags` is what the reduction found.
struct alignas(16) CallHeader {
  int32_t version = 0;  // kHeaderVersion: a build that speaks another header
  int32_t kind = 0;     // CallKind
  int32_t op = 0;       // the op's code (OpName)
  int32_t type = 0;     // the XLA element type (TypeName)
  int64_t count = 0;    // elements
  int64_t carried = 0;  // elements carried behind this header (0 or count)
  int64_t chunk_bytes = 0;  // MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES
  int64_t seq = 0;          // the call's number on its communicator
  uint32_t flags = 0;       // kDisagree once headers that differ met
  uint32_t reserved = 0;
  int64_t site_key = 0;  // where the call was made (Record::Key), or its name
};
static_assert(sizeof(CallHeader) == 64, "the header is a fixed 64 bytes");
constexpr size_t kHeaderBytes = sizeof(CallHeader);
constexpr int32_t kHeaderVersion = 0x6d6a0002;
constexpr uint32_t kDisagree = 1;

// Payloads up to this many bytes go in one message with their header.
// Measured on MPICH 5 (2 ranks, shared memory): one message of header and
// payload reduced by CheckedOp costs what MPI_Allreduce of the payload alone
// does up to 16 KiB (copies included), and 1.3x at 64 KiB; the header alone,
// posted beside the data, costs nothing measurable from 64 KiB (0.97x) but
// 2.4x at 4 B (throwaway C programs, 2026-12-04; benchmarks/allreduce.py's
// mpi4jax_dist_unchecked shows the checks' cost in the package as built).
constexpr size_t kCombinedBytes = size_t{16} << 10;

// Under Open MPI 5 a reduction whose ranks send messages of different sizes
// does not fail cleanly: where the longer one goes by rendezvous (above 4 KiB
// over shared memory) the rank that receives it corrupts its heap (then aborts,
// or hangs in Open MPI's own crash handler), and a non-blocking one leaves the
// other rank waiting for good (mpi4py alone, 2 ranks, 2026-12-06;
// tests/scripts/fail_safe.py's imismatch). There the first message of every
// checked call is one size whatever the call: its header with up to
// kOneSizePayload bytes of payload, or the header alone padded to as much; a
// larger payload is posted only once the ranks have agreed on the header. One
// more message's latency for payloads above kOneSizePayload (the price of
// checks there; MPICH and Intel MPI fail a longer message cleanly).
constexpr size_t kOneSizePayload = 192;

// Whether the first message of a call must be one size (the MPI is Open MPI:
// MPI_Get_library_version, asked once).
MPI4JAX_DIST_CORE_API bool OneSizeFirst();

// Payloads up to this many bytes go in one message with their header:
// kCombinedBytes, or kOneSizePayload where OneSizeFirst.
MPI4JAX_DIST_CORE_API size_t CombinedLimit();

// A header posted apart from its payload, with what pads it to the first
// message's one size where OneSizeFirst (AlonePadBytes: 0 elsewhere).
struct alignas(16) HeaderAlone {
  CallHeader header;
  char pad[kOneSizePayload] = {};
};
MPI4JAX_DIST_CORE_API size_t AlonePadBytes();

// The bytes a payload of `bytes` (at most CombinedLimit) takes behind its
// header in one message: up to 64 bytes, 64; up to 4 KiB with its header, the
// power of two that holds both; above, itself; where OneSizeFirst, always
// kOneSizePayload. Ranks whose counts differ then mostly send messages of
// one size, which the header tells apart: MPICH 5's shared-memory
// MPI_Allreduce aborts the job on a longer message than its own, whatever the
// communicator's error handler says. Padding a message this small costs no
// time a benchmark sees (the reduction reads `carried` elements only).
MPI4JAX_DIST_CORE_API size_t PaddedBytes(size_t bytes);

// The reduction op of headers (CheckedReduce: headers that differ mark the
// result and leave the payload alone), made once MPI is up. Never freed: MPI
// frees it at MPI_Finalize.
MPI4JAX_DIST_CORE_API MPI_Op CheckedOp();

// The datatype of one header and `payload_bytes` behind it: one element,
// which MPI can neither split nor pipeline, so that the reduction always sees
// a header with its payload. Made once per size, then looked up.
MPI4JAX_DIST_CORE_API MPI_Datatype CheckedType(size_t payload_bytes);

// Memory for one header and up to kCombinedBytes, this thread's (XLA runs one
// handler on one thread from entry to return).
MPI4JAX_DIST_CORE_API char* Scratch();

// Post (request non-null) or run the reduction of `buffer`, a header and
// `payload_bytes` behind it, in place, on `comm`. `guarded`: the caller holds
// the MPI lock already (MpiGuard), and has made the op and the type before.
MPI4JAX_DIST_CORE_API int ReduceChecked(char* buffer, size_t payload_bytes,
                                        MPI_Comm comm, MPI_Request* request,
                                        bool guarded = false);

// Complete a payload's request `data` and the request of its header, posted
// before it apart (`header` is what it reduces in place), judging the header
// as soon as it completes. Where it says that the ranks disagree, or fails,
// `data` may never complete (a rank that called otherwise posted nothing to
// match it): it is left pending, *disagreed set, and its memory must outlive
// it. Returns the payload's MPI error (or success); the header's in *header_rc.
MPI4JAX_DIST_CORE_API int CompleteJudged(MPI_Request* header_request,
                                         const CallHeader& header,
                                         MPI_Request* data, int* header_rc,
                                         bool* disagreed);

// The last disagreement this process reported, for the Python side: whether
// this rank words it for the job (the communicator's rank 0) and the text.
struct Disagreement {
  std::mutex mu;
  bool seen = false;
  bool reporter = false;
  std::string text;
};

MPI4JAX_DIST_CORE_API Disagreement& LastDisagreement();

// Explain a call that the ranks disagree on (the reduction said so, or MPI
// failed on it): every rank's side gathered to rank 0 of `comm`, which words
// the report and sends it to every rank. Every rank returns the same error;
// bounded by 10 s where a rank does not take part.
MPI4JAX_DIST_CORE_API ffi::Error Explain(MPI_Comm comm, const CallHeader& mine,
                                         const char* site, const char* who,
                                         const std::string& comm_name,
                                         int mpi_error);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_AGREEMENT_H_
