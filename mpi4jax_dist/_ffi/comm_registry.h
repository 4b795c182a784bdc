// Communicators as compiled code names them: Python registers each one
// (register_comm) and the compiled call carries its id, which MPI's attribute
// delete callback marks freed with the communicator. The first call on each
// (every call with MPI4JAX_DIST_DEBUG_CHECKS) checks that the ranks agree on
// it: ranks that disagree on the count hang once the message goes in chunks.

#ifndef MPI4JAX_DIST_FFI_COMM_REGISTRY_H_
#define MPI4JAX_DIST_FFI_COMM_REGISTRY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mpi_base.h"
#include "mpi_guard.h"
#include "timeout.h"

namespace mpi4jax_dist {

class CommRegistry {
 public:
  struct Entry {
    MPI_Comm comm = MPI_COMM_NULL;
    std::atomic<bool> freed{false};
    // Whether a call on it has checked the ranks' agreement already.
    std::atomic<bool> checked{false};
    // The calls entered on it in this process (allreduce, iallreduce's
    // start), for the collective timeout's report.
    std::atomic<int64_t> calls{0};
  };

  // Never destroyed: MPI may call the delete callback at MPI_Finalize, from
  // an atexit handler, after static destructors could have run.
  static CommRegistry& Get() {
    static CommRegistry* registry = new CommRegistry();
    return *registry;
  }

  // The id of the communicator of Fortran handle `handle`, registering it
  // first if it is new. MPI must be usable (CheckMpiUsable).
  ffi::Error Register(int64_t handle, int64_t* id,
                      const char* who = kAllreduceName) {
    std::lock_guard<std::mutex> lock(mu_);
    MpiGuard guard;  // after mu_: see MpiGuard's lock order
    MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(handle));
    if (comm == MPI_COMM_NULL) {
      return ffi::Error::InvalidArgument(std::string(who) +
                                         ": the communicator is MPI_COMM_NULL");
    }
    if (keyval_ == MPI_KEYVAL_INVALID) {
      int rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, OnFree, &keyval_,
                                      nullptr);
      if (rc != MPI_SUCCESS) {
        keyval_ = MPI_KEYVAL_INVALID;
        return MpiError("MPI_Comm_create_keyval", rc, who);
      }
    }
    void* value = nullptr;
    int found = 0;
    int rc = MPI_Comm_get_attr(comm, keyval_, &value, &found);
    if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_get_attr", rc, who);
    if (found) {
      *id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
      return ffi::Error::Success();
    }
    entries_.push_back(std::make_unique<Entry>());
    entries_.back()->comm = comm;
    const int64_t new_id = static_cast<int64_t>(entries_.size());
    rc = MPI_Comm_set_attr(
        comm, keyval_, reinterpret_cast<void*>(static_cast<intptr_t>(new_id)));
    if (rc != MPI_SUCCESS) {
      entries_.pop_back();
      return MpiError("MPI_Comm_set_attr", rc, who);
    }
    *id = new_id;
    return ffi::Error::Success();
  }

  // The live communicator of `id`, and whether this call is the first on it
  // to check the ranks' agreement (see CheckAgreement).
  ffi::Error Find(int64_t id, MPI_Comm* comm, bool* first,
                  const char* who = kAllreduceName) {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < 1 || id > static_cast<int64_t>(entries_.size())) {
      return ffi::Error::InvalidArgument(
          std::string(who) + ": communicator id " + std::to_string(id) +
          " was never registered in this process (was the function compiled "
          "in another process, or by another build of mpi4jax_dist?)");
    }
    Entry& entry = *entries_[id - 1];
    if (entry.freed.load()) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          std::string(who) +
              ": the communicator this function was compiled for has been "
              "freed (comm.Free()) since; MPI may have given its handle to "
              "another communicator. Call the function with a live "
              "communicator (jax.jit traces it again for a new one).");
    }
    *comm = entry.comm;
    *first = !entry.checked.exchange(true);
    return ffi::Error::Success();
  }

  // Count a call entered on `id` (found live by Find); return its number.
  int64_t CountCall(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_[id - 1]->calls.fetch_add(1) + 1;
  }

  // Every registered communicator's count of calls, by id (index id - 1).
  std::vector<int64_t> CallCounts() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> counts;
    for (const auto& entry : entries_) counts.push_back(entry->calls.load());
    return counts;
  }

 private:
  // MPI's attribute delete callback: the communicator is being freed (or MPI
  // finalized, for COMM_WORLD and COMM_SELF).
  static int OnFree(MPI_Comm, int, void* value, void*) {
    CommRegistry& registry = Get();
    std::lock_guard<std::mutex> lock(registry.mu_);
    const int64_t id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
    if (id >= 1 && id <= static_cast<int64_t>(registry.entries_.size())) {
      registry.entries_[id - 1]->freed.store(true);
    }
    return MPI_SUCCESS;
  }

  std::mutex mu_;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::vector<std::unique_ptr<Entry>> entries_;
};

// The communicator of compiled id `comm_id`; `*first` tells whether this call
// is the first on it (it then checks the ranks' agreement).
inline ffi::Error CommFromId(int64_t comm_id, MPI_Comm* comm, bool* first,
                             const char* who = kAllreduceName) {
  return CommRegistry::Get().Find(comm_id, comm, first, who);
}

// Whether every rank of a communicator makes a call alike: the same element
// count, element type, op and chunk size. One MPI_Allreduce (MPI_MAX) of each
// value and its negation (AgreementValues): the ranks agree where both maxima
// give the value back (AgreementVerdict). Every rank sees the same maxima, so
// every rank fails alike, and none is left waiting in a chunk the others never
// post. Made on a communicator's first call, and on every call with
// MPI4JAX_DIST_DEBUG_CHECKS=1; blocking in the allreduce (CheckAgreement),
// posted beside the reduction in the non-blocking start and judged in its wait.
constexpr int kAgreementValues = 8;

inline void AgreementValues(size_t count, ffi::DataType dtype, int32_t op_code,
                            int64_t chunk_bytes,
                            int64_t out[kAgreementValues]) {
  const int64_t mine[4] = {static_cast<int64_t>(count),
                           static_cast<int64_t>(dtype), op_code, chunk_bytes};
  for (int i = 0; i < 4; ++i) {
    out[i] = mine[i];
    out[4 + i] = -mine[i];
  }
}

// The error naming what differs between `mine` (AgreementValues) and the
// ranks' maxima `most`; success where nothing does.
inline ffi::Error AgreementVerdict(const int64_t mine[kAgreementValues],
                                   const int64_t most[kAgreementValues],
                                   const char* who) {
  static const char* const kWhat[4] = {"element count", "element type (XLA)",
                                       "op code", "chunk bytes"};
  std::string differ;
  for (int i = 0; i < 4; ++i) {
    if (most[i] != mine[i] || -most[4 + i] != mine[i]) {
      differ += std::string(differ.empty() ? "" : "; ") + kWhat[i] + " from " +
                std::to_string(-most[4 + i]) + " to " +
                std::to_string(most[i]) + " (this rank " +
                std::to_string(mine[i]) + ")";
    }
  }
  if (differ.empty()) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string(who) +
      ": the ranks of the communicator disagree on this call: " + differ +
      ". Every rank must reduce an array of the same shape and dtype with the "
      "same op (and the same MPI4JAX_DIST_ALLREDUCE_CHUNK_BYTES); otherwise "
      "MPI hangs, or returns wrong values.");
}

// The blocking check, for the allreduce.
inline ffi::Error CheckAgreement(MPI_Comm comm, size_t count,
                                 ffi::DataType dtype, int32_t op_code,
                                 int64_t chunk_bytes, const char* who) {
  int64_t mine[kAgreementValues], most[kAgreementValues];
  AgreementValues(count, dtype, op_code, chunk_bytes, mine);
  int rc = MPI_SUCCESS;
  if (CurrentCall().deadline_ns != 0) {  // the collective timeout: polled
    MPI_Request request = MPI_REQUEST_NULL;
    {
      MpiGuard guard;
      rc = MPI_Iallreduce(mine, most, kAgreementValues, MPI_INT64_T, MPI_MAX,
                          comm, &request);
    }
    if (rc == MPI_SUCCESS) rc = WaitRequest(&request);
  } else {
    MpiGuard guard;
    rc =
        MPI_Allreduce(mine, most, kAgreementValues, MPI_INT64_T, MPI_MAX, comm);
  }
  if (rc != MPI_SUCCESS) {
    return MpiError("MPI_Allreduce (agreement check)", rc, who);
  }
  return AgreementVerdict(mine, most, who);
}

// When a call checks the ranks' agreement: on the first call on its
// communicator, or on every call (MPI4JAX_DIST_DEBUG_CHECKS).
enum class Agreement { kFirstCall, kEveryCall };

// The handlers' `check` attribute (MPI4JAX_DIST_DEBUG_CHECKS) as an Agreement.
inline Agreement AgreementFor(int32_t check) {
  return check ? Agreement::kEveryCall : Agreement::kFirstCall;
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_COMM_REGISTRY_H_
