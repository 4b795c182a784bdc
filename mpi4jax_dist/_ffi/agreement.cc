// Every call checked against its peers before it returns a value (agreement.h):
// the reduction of headers, and the explanation of a disagreement. In the core.

#include "agreement.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "mpi_guard.h"
#include "record.h"
#include "timeout.h"

namespace mpi4jax_dist {

bool OneSizeFirst() {
  static const bool open_mpi = [] {
    char version[MPI_MAX_LIBRARY_VERSION_STRING] = {};
    int length = 0;
    MPI_Get_library_version(version, &length);
    return std::strstr(version, "Open MPI") != nullptr;
  }();
  return open_mpi;
}

size_t CombinedLimit() {
  return OneSizeFirst() ? kOneSizePayload : kCombinedBytes;
}

size_t AlonePadBytes() { return OneSizeFirst() ? kOneSizePayload : 0; }

size_t PaddedBytes(size_t bytes) {
  if (OneSizeFirst()) return kOneSizePayload;
  if (bytes <= 64) return 64;
  size_t total = kHeaderBytes + bytes;
  if (total > 4096) return bytes;
  size_t padded = 128;
  while (padded < total) padded *= 2;
  return padded - kHeaderBytes;
}

namespace {

bool SameCall(const CallHeader& a, const CallHeader& b) {
  return a.version == b.version && a.kind == b.kind && a.op == b.op &&
         a.type == b.type && a.count == b.count && a.carried == b.carried &&
         a.chunk_bytes == b.chunk_bytes && a.seq == b.seq &&
         a.site_key == b.site_key;
}

// --- the reduction of payloads, as MPI's predefined ops do it ---------------

namespace reduce {

// MPICH's MPL_MIN and MPL_MAX, operand order included (NaNs come out alike).
template <typename T>
T Min(T a, T b) {
  return a > b ? b : a;
}
template <typename T>
T Max(T a, T b) {
  return a > b ? a : b;
}

// inout[i] = in[i] op inout[i] for an integer type (wrapping arithmetic, as
// MPI's C integers do, without C's undefined signed overflow).
template <typename T>
void Integers(int32_t op, const T* in, T* io, size_t n) {
  using U = std::make_unsigned_t<T>;
  switch (op) {
    case 0:  // SUM
      for (size_t i = 0; i < n; ++i)
        io[i] = static_cast<T>(static_cast<U>(in[i]) + static_cast<U>(io[i]));
      break;
    case 1:  // PROD
      for (size_t i = 0; i < n; ++i)
        io[i] = static_cast<T>(static_cast<U>(in[i]) * static_cast<U>(io[i]));
      break;
    case 2:
      for (size_t i = 0; i < n; ++i) io[i] = Min(in[i], io[i]);
      break;
    case 3:
      for (size_t i = 0; i < n; ++i) io[i] = Max(in[i], io[i]);
      break;
    case 4:  // LAND
      for (size_t i = 0; i < n; ++i) io[i] = (in[i] && io[i]);
      break;
    case 5:  // LOR
      for (size_t i = 0; i < n; ++i) io[i] = (in[i] || io[i]);
      break;
    case 6:  // LXOR
      for (size_t i = 0; i < n; ++i) io[i] = (!in[i] != !io[i]);
      break;
    case 7:
      for (size_t i = 0; i < n; ++i) io[i] = in[i] & io[i];
      break;
    case 8:
      for (size_t i = 0; i < n; ++i) io[i] = in[i] | io[i];
      break;
    case 9:
      for (size_t i = 0; i < n; ++i) io[i] = in[i] ^ io[i];
      break;
  }
}

template <typename T>
void Floats(int32_t op, const T* in, T* io, size_t n) {
  switch (op) {
    case 0:
      for (size_t i = 0; i < n; ++i) io[i] = in[i] + io[i];
      break;
    case 1:
      for (size_t i = 0; i < n; ++i) io[i] = in[i] * io[i];
      break;
    case 2:
      for (size_t i = 0; i < n; ++i) io[i] = Min(in[i], io[i]);
      break;
    case 3:
      for (size_t i = 0; i < n; ++i) io[i] = Max(in[i], io[i]);
      break;
  }
}

// Complex numbers as pairs, multiplied as MPICH does (no C99 Annex G).
template <typename T>
void Complex(int32_t op, const T* in, T* io, size_t n) {
  if (op == 0) {
    for (size_t i = 0; i < 2 * n; ++i) io[i] = in[i] + io[i];
  } else if (op == 1) {
    for (size_t i = 0; i < n; ++i) {
      const T ar = in[2 * i], ai = in[2 * i + 1];
      const T br = io[2 * i], bi = io[2 * i + 1];
      io[2 * i] = ar * br - ai * bi;
      io[2 * i + 1] = ar * bi + ai * br;
    }
  }
}

void Payload(int32_t op, int32_t type, const void* in, void* io,
                    size_t n) {
  switch (static_cast<ffi::DataType>(type)) {
    case ffi::DataType::PRED:  // C bool: one byte, 0 or 1
      return Integers(op, static_cast<const uint8_t*>(in),
                      static_cast<uint8_t*>(io), n);
    case ffi::DataType::S8:
      return Integers(op, static_cast<const int8_t*>(in),
                      static_cast<int8_t*>(io), n);
    case ffi::DataType::S16:
      return Integers(op, static_cast<const int16_t*>(in),
                      static_cast<int16_t*>(io), n);
    case ffi::DataType::S32:
      return Integers(op, static_cast<const int32_t*>(in),
                      static_cast<int32_t*>(io), n);
    case ffi::DataType::S64:
      return Integers(op, static_cast<const int64_t*>(in),
                      static_cast<int64_t*>(io), n);
    case ffi::DataType::U8:
      return Integers(op, static_cast<const uint8_t*>(in),
                      static_cast<uint8_t*>(io), n);
    case ffi::DataType::U16:
      return Integers(op, static_cast<const uint16_t*>(in),
                      static_cast<uint16_t*>(io), n);
    case ffi::DataType::U32:
      return Integers(op, static_cast<const uint32_t*>(in),
                      static_cast<uint32_t*>(io), n);
    case ffi::DataType::U64:
      return Integers(op, static_cast<const uint64_t*>(in),
                      static_cast<uint64_t*>(io), n);
    case ffi::DataType::F32:
      return Floats(op, static_cast<const float*>(in), static_cast<float*>(io),
                    n);
    case ffi::DataType::F64:
      return Floats(op, static_cast<const double*>(in),
                    static_cast<double*>(io), n);
    case ffi::DataType::C64:
      return Complex(op, static_cast<const float*>(in), static_cast<float*>(io),
                     n);
    case ffi::DataType::C128:
      return Complex(op, static_cast<const double*>(in),
                     static_cast<double*>(io), n);
    default:
      return;
  }
}

}  // namespace reduce

// MPI's user function of CheckedOp: `inout` = `in` combined with `inout`, one
// element of our datatype (a header and what it carries). Headers that differ
// mark the result and leave the payload alone (it would be read with the
// wrong length or type); a marked side marks the result. Calls no MPI.
void CheckedReduce(void* in, void* inout, int* len, MPI_Datatype*) {
  if (*len < 1) return;
  auto* a = static_cast<CallHeader*>(in);
  auto* b = static_cast<CallHeader*>(inout);
  const uint32_t flags = a->flags | b->flags | (SameCall(*a, *b) ? 0 : kDisagree);
  if (flags == 0 && b->carried > 0) {
    reduce::Payload(b->op, b->type, reinterpret_cast<const char*>(a + 1),
                    reinterpret_cast<char*>(b + 1),
                    static_cast<size_t>(b->carried));
  }
  b->flags = flags;
}

}  // namespace

// The reduction op of headers, made once MPI is up (commutative: every op the
// payloads take is). Never freed: MPI frees it at MPI_Finalize.
MPI_Op CheckedOp() {
  static MPI_Op op = [] {
    MPI_Op made = MPI_OP_NULL;
    MpiGuard guard;
    MPI_Op_create(&CheckedReduce, 1, &made);
    return made;
  }();
  return op;
}

// The datatype of one header and `payload_bytes` behind it: one element,
// which MPI can neither split nor pipeline, so that CheckedReduce always sees
// a header with its payload. Made once per size (a few sizes per program),
// then looked up.
MPI_Datatype CheckedType(size_t payload_bytes) {
  thread_local size_t last_bytes = SIZE_MAX;
  thread_local MPI_Datatype last_type = MPI_DATATYPE_NULL;
  if (payload_bytes == last_bytes) return last_type;
  static std::mutex* mu = new std::mutex();
  static auto* types = new std::map<size_t, MPI_Datatype>();
  std::lock_guard<std::mutex> lock(*mu);
  auto found = types->find(payload_bytes);
  if (found == types->end()) {
    MPI_Datatype made = MPI_DATATYPE_NULL;
    {
      MpiGuard guard;  // after mu: MpiGuard's lock order
      MPI_Type_contiguous(static_cast<int>(kHeaderBytes + payload_bytes),
                          MPI_BYTE, &made);
      MPI_Type_commit(&made);
    }
    found = types->emplace(payload_bytes, made).first;
  }
  const MPI_Datatype type = found->second;
  last_bytes = payload_bytes;
  last_type = type;
  return type;
}

// Memory for one header and up to kCombinedBytes, this thread's (XLA runs one
// handler on one thread from entry to return).
char* Scratch() {
  struct alignas(64) Block {
    char bytes[kHeaderBytes + kCombinedBytes];
  };
  thread_local std::unique_ptr<Block> block(new Block());
  return block->bytes;
}

// Post (request non-null) or run the reduction of `buffer`, a header and
// `payload_bytes` behind it, in place, on `comm`. `guarded`: the caller holds
// the MPI lock already (MpiGuard), and has made the op and the type before.
int ReduceChecked(char* buffer, size_t payload_bytes, MPI_Comm comm,
                  MPI_Request* request, bool guarded) {
  const MPI_Datatype type = CheckedType(payload_bytes);
  const MPI_Op op = CheckedOp();
  auto run = [&] {
    return request != nullptr
               ? MPI_Iallreduce(MPI_IN_PLACE, buffer, 1, type, op, comm,
                                request)
               : MPI_Allreduce(MPI_IN_PLACE, buffer, 1, type, op, comm);
  };
  if (guarded) return run();
  MpiGuard guard;
  return run();
}

// Complete a payload's request `data` and the request of its header, posted
// before it apart (`header` is what it reduces in place), judging the header
// as soon as it completes. Where it says that the ranks disagree, or fails,
// `data` may never complete (a rank that called otherwise posted nothing to
// match it): it is left pending, *disagreed set, and its memory must outlive
// it. Returns the payload's MPI error (or success); the header's in *header_rc.
int CompleteJudged(MPI_Request* header_request, const CallHeader& header,
                   MPI_Request* data, int* header_rc, bool* disagreed) {
  *header_rc = MPI_SUCCESS;
  *disagreed = false;
  if (*header_request == MPI_REQUEST_NULL) return WaitRequest(data);
  MPI_Request requests[2] = {*header_request, *data};
  int index = MPI_UNDEFINED;
  int rc = WaitAnyRequest(2, requests, &index);
  *header_request = requests[0];
  *data = requests[1];
  if (index == 1) {  // the payload first (or its error): then the header
    *header_rc = WaitRequest(header_request);
    *disagreed = *header_rc != MPI_SUCCESS || header.flags != 0;
    return rc;
  }
  // The header first (or its error, or MPI's on the call itself).
  *header_rc = rc;
  if (rc != MPI_SUCCESS || header.flags != 0) {
    *disagreed = true;
    return MPI_SUCCESS;
  }
  return WaitRequest(data);
}

// --- saying what the ranks disagree on ---------------------------------------

namespace {

// "rank 3", "ranks 0-2, 7" (at most `limit` runs, then how many more).
std::string RanksText(std::vector<int> ranks, size_t limit = 8) {
  std::sort(ranks.begin(), ranks.end());
  std::vector<std::pair<int, int>> runs;
  for (int r : ranks) {
    if (!runs.empty() && r == runs.back().second + 1) {
      runs.back().second = r;
    } else {
      runs.push_back({r, r});
    }
  }
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  size_t rest = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    if (i >= limit) {
      rest += runs[i].second - runs[i].first + 1;
      continue;
    }
    if (i) text += ", ";
    text += std::to_string(runs[i].first);
    if (runs[i].second != runs[i].first) {
      text += "-" + std::to_string(runs[i].second);
    }
  }
  if (rest) text += " and " + std::to_string(rest) + " more";
  return text;
}

// One rank's side, as gathered to the communicator's rank 0: its header, its
// rank in MPI_COMM_WORLD and where its user made the call.
struct Side {
  CallHeader header;
  int32_t world_rank = -1;
  int32_t reserved = 0;
  char site[184] = {};
};
static_assert(sizeof(Side) == 256, "a side is 256 bytes");

// Complete `request` within `seconds` (polled, each test under the MPI lock
// where MPI is serialized); false when it did not, or failed.
bool CompleteWithin(MPI_Request* request, double seconds) {
  const int64_t deadline = SteadyNs() + static_cast<int64_t>(seconds * 1e9);
  for (;;) {
    int done = 0, rc = MPI_SUCCESS;
    {
      MpiGuard guard;
      rc = MPI_Test(request, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) return false;
    if (done) return true;
    if (SteadyNs() > deadline) return false;
    std::this_thread::yield();
  }
}

// How long the explanation's collectives may take: a rank that never joins
// them (it is elsewhere, or its MPI failed) must not hold the others.
constexpr double kExplainS = 10.0;


// What rank 0 words from every rank's side, for every rank's report: the
// call's number, then each group of ranks and what they called where; *alike
// says that every rank made the same call (then MPI itself failed on it).
std::string Sides(const std::vector<Side>& sides, bool* alike) {
  // Ranks grouped by what they called where; the smallest groups first (the
  // odd ones out), then by their lowest rank.
  std::map<std::string, std::vector<int>> groups;
  int64_t seq = 0, chunk_bytes = 0;
  for (const Side& s : sides) {
    if (s.header.kind == kBlocking) {
      chunk_bytes = s.header.chunk_bytes;
      break;
    }
  }
  for (const Side& s : sides) {
    const CallHeader& h = s.header;
    seq = std::max(seq, h.seq);
    std::string call =
        h.version != kHeaderVersion
            ? std::string("a call of another mpi4jax_dist build")
            : CallText(h.kind, h.seq, h.op, h.type, h.count);
    // Chunks matter to blocking calls only (a request is one MPI call).
    if (h.version == kHeaderVersion && h.kind == kBlocking &&
        h.chunk_bytes != chunk_bytes) {
      call += " in chunks of " + std::to_string(h.chunk_bytes) + " bytes";
    }
    if (s.site[0]) call += std::string(" at ") + s.site;
    // A place cut short, or past the table of places, may read alike for
    // two keys: its key tells them apart.
    const size_t length = strnlen(s.site, sizeof s.site);
    if (h.version == kHeaderVersion &&
        (length == 0 || length + 1 >= sizeof s.site)) {
      call += " (site key " + std::to_string(h.site_key) + ")";
    }
    groups[call].push_back(s.world_rank);
  }
  std::vector<std::pair<std::string, std::vector<int>>> ordered(groups.begin(),
                                                                groups.end());
  *alike = ordered.size() == 1;
  std::sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    if (a.second.size() != b.second.size())
      return a.second.size() < b.second.size();
    return *std::min_element(a.second.begin(), a.second.end()) <
           *std::min_element(b.second.begin(), b.second.end());
  });
  std::string text = "#" + std::to_string(seq) + ": ";
  for (size_t i = 0; i < ordered.size(); ++i) {
    if (i) text += "; ";
    text += RanksText(ordered[i].second) + " in " + ordered[i].first;
  }
  return text;
}

}  // namespace

Disagreement& LastDisagreement() {
  static Disagreement* last = new Disagreement();
  return *last;
}

// Explain a call that the ranks disagree on (the reduction said so, or MPI
// failed on it): every rank's side gathered to rank 0 of `comm`, which words
// the report and sends it to every rank. Every rank returns the same error;
// bounded by kExplainS where a rank does not take part.
ffi::Error Explain(MPI_Comm comm, const CallHeader& mine, const char* site,
                   const char* who, const std::string& comm_name,
                   int mpi_error) {
  int rank = 0, size = 1, world_rank = 0;
  {
    MpiGuard guard;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  }
  Side side;
  side.header = mine;
  side.header.flags = 0;
  side.world_rank = world_rank;
  std::snprintf(side.site, sizeof side.site, "%s", site);
  std::vector<Side> sides(rank == 0 ? size : 0);
  std::string text;
  bool gathered = false;
  MPI_Request request = MPI_REQUEST_NULL;
  int rc = MPI_SUCCESS;
  {
    MpiGuard guard;
    rc = MPI_Igather(&side, sizeof(Side), MPI_BYTE, sides.data(), sizeof(Side),
                     MPI_BYTE, 0, comm, &request);
  }
  bool alike = false;
  if (rc == MPI_SUCCESS && CompleteWithin(&request, kExplainS)) {
    int64_t length = 0;  // negative: every rank made the same call
    if (rank == 0) {
      text = Sides(sides, &alike);
      length = static_cast<int64_t>(text.size()) * (alike ? -1 : 1);
    }
    {
      MpiGuard guard;
      rc = MPI_Ibcast(&length, 1, MPI_INT64_T, 0, comm, &request);
    }
    if (rc == MPI_SUCCESS && CompleteWithin(&request, kExplainS)) {
      alike = length < 0;
      length = length < 0 ? -length : length;
      text.resize(static_cast<size_t>(length));
      {
        MpiGuard guard;
        rc = MPI_Ibcast(text.data(), static_cast<int>(length), MPI_CHAR, 0,
                        comm, &request);
      }
      gathered = rc == MPI_SUCCESS && CompleteWithin(&request, kExplainS);
    }
  }
  if (mpi_error != MPI_SUCCESS && (alike || !gathered)) {
    // The same call everywhere, or no way to tell: MPI's own error.
    return MpiError("MPI_Allreduce", mpi_error, who);
  }
  // Every rank words the report alike from what rank 0 sent.
  ffi::Error error =
      gathered
          ? ffi::Error(
                ffi::ErrorCode::kFailedPrecondition,
                std::string(who) + ": the ranks of " + comm_name +
                    " disagree on its call " + text +
                    ". No rank returned a value from it (MPI4JAX_DIST_CHECKS). "
                    "Every rank must make the same calls on a communicator in "
                    "the same order: the same op, dtype and element count, "
                    "from the same line of code (or under the same site= "
                    "name), all blocking (allreduce) or all non-blocking "
                    "(iallreduce).")
          : ffi::Error(
                ffi::ErrorCode::kFailedPrecondition,
                std::string(who) + ": the ranks of " + comm_name +
                    " disagree on a call there (this rank, " +
                    std::to_string(world_rank) + ": " +
                    CallText(mine.kind, mine.seq, mine.op, mine.type,
                             mine.count) +
                    (site[0] ? std::string(" at ") + site : std::string()) +
                    "), and the other ranks' calls could not be gathered in " +
                    std::to_string(static_cast<int>(kExplainS)) +
                    " s. Every rank must make the same calls on a communicator "
                    "in the same order.");
  {
    Disagreement& last = LastDisagreement();
    std::lock_guard<std::mutex> lock(last.mu);
    last.seen = true;
    last.reporter = gathered ? rank == 0 : true;
    last.text = std::string(error.message());
  }
  return error;
}

}  // namespace mpi4jax_dist
