// Communicators as compiled code names them: Python registers each one
// (register_comm) and the compiled call carries its id, which MPI's attribute
// delete callback marks freed with the communicator.
//
// The calls run on a private duplicate of the user's communicator, made on the
// first call (MPI_Comm_idup, polled under the collective timeout): the
// package's messages never meet the user's own mpi4py or mpi4jax calls on it,
// and MPI's errors there are returned (MPI_ERRORS_RETURN), so that a failed
// call is an error naming the call rather than MPI aborting the job.

#ifndef MPI4JAX_DIST_FFI_COMM_REGISTRY_H_
#define MPI4JAX_DIST_FFI_COMM_REGISTRY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mpi_base.h"
#include "mpi_guard.h"
#include "timeout.h"

namespace mpi4jax_dist {

// A communicator's group as every member of it names it alike: FNV-1a of its
// ranks in MPI_COMM_WORLD and their number, never 0. O(P), once per
// communicator. Called with the MPI lock held.
inline uint64_t GroupHash(MPI_Comm comm) {
  MPI_Group group = MPI_GROUP_NULL, world = MPI_GROUP_NULL;
  int size = 0;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a's offset basis
  auto mix = [&hash](uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xff;
      hash *= 1099511628211ull;  // FNV-1a's prime
    }
  };
  if (MPI_Comm_group(comm, &group) == MPI_SUCCESS &&
      MPI_Comm_group(MPI_COMM_WORLD, &world) == MPI_SUCCESS &&
      MPI_Group_size(group, &size) == MPI_SUCCESS && size > 0) {
    std::vector<int> ranks(size), in_world(size);
    for (int i = 0; i < size; ++i) ranks[i] = i;
    MPI_Group_translate_ranks(group, size, ranks.data(), world,
                              in_world.data());
    for (int r : in_world) mix(static_cast<uint64_t>(static_cast<int64_t>(r)));
  }
  if (group != MPI_GROUP_NULL) MPI_Group_free(&group);
  if (world != MPI_GROUP_NULL) MPI_Group_free(&world);
  mix(static_cast<uint64_t>(size));
  return hash | 1;
}

// A communicator as every member of it names it alike once its duplicates are
// made, for the watchdog's comparisons of where the ranks wait
// (mpi4jax_dist/faults/standstill.py): its group's hash mixed with its place
// among the communicators of that group whose duplicates this process has
// made, in the order made (making them is a collective every member makes, in
// one order), never 0.
inline uint64_t MadeKey(uint64_t group_hash) {
  static std::mutex* mu = new std::mutex();
  static auto* made = new std::map<uint64_t, uint64_t>();
  uint64_t place = 0;
  {
    std::lock_guard<std::mutex> lock(*mu);
    place = (*made)[group_hash]++;
  }
  uint64_t hash = group_hash;
  for (int byte = 0; byte < 8; ++byte) {
    hash ^= (place >> (8 * byte)) & 0xff;
    hash *= 1099511628211ull;
  }
  return hash | 1;
}

class CommRegistry {
 public:
  struct Entry {
    MPI_Comm comm = MPI_COMM_NULL;  // the user's
    std::string name;               // "communicator 'NAME' (P ranks)"
    int size = 0;                   // P
    std::atomic<bool> freed{false};
    // The calls entered on it in this process (allreduce, iallreduce's
    // start): each call's number, and the collective timeout's report.
    std::atomic<int64_t> calls{0};
    // The private duplicates: made by the first call that needs them
    // (PrivateComm). `dup` carries the calls, `explain` a disagreement's
    // explanation (agreement.h), apart from a call that may stay pending.
    std::mutex dup_mu;
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Comm explain = MPI_COMM_NULL;
    MPI_Request dup_requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    std::atomic<int> dup_state{0};  // 0 none, 1 being made, 2 ready
    // The call whose ranks disagreed (0: none): MPI may still hold a request
    // of it on `dup`, so no later call may use it.
    std::atomic<int64_t> broken_at{0};
    // The communicator as every member names it alike: its group (GroupHash),
    // and once its duplicates are made, which of that group's (MadeKey; 0
    // before).
    uint64_t group_hash = 0;
    std::atomic<uint64_t> global_key{0};
    // The handlers running a call on it now (Turn, allreduce.h): more than one
    // means programs that nothing orders against each other.
    std::atomic<int> active{0};
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
    FreeRetired();
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
    Entry& entry = *entries_.back();
    entry.comm = comm;
    char name[MPI_MAX_OBJECT_NAME] = "";
    int length = 0, size = 0;
    MPI_Comm_get_name(comm, name, &length);
    MPI_Comm_size(comm, &size);
    entry.name = (length ? "communicator '" + std::string(name, length) + "'"
                         : std::string("a communicator")) +
                 " (" + std::to_string(size) + " ranks)";
    entry.size = size;
    entry.group_hash = GroupHash(comm);
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

  // The live entry of `id`, or an error naming what is wrong.
  ffi::Error Find(int64_t id, Entry** out, const char* who = kAllreduceName) {
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
    *out = &entry;
    return ffi::Error::Success();
  }

  // Count a call entered on `id` (found live by Find); return its number.
  int64_t CountCall(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_[id - 1]->calls.fetch_add(1) + 1;
  }

  // The communicator `id` as every member names it (Entry::global_key; until
  // its first call has made its duplicates, its group's hash with the low bit
  // cleared: alike on every member then too, and never a made key), as the
  // reports do, and its size; 0, "" and 0 for an id never registered.
  struct Description {
    uint64_t key = 0;
    std::string name;
    int size = 0;
  };
  Description Describe(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (id < 1 || id > static_cast<int64_t>(entries_.size())) return {};
    const Entry& entry = *entries_[id - 1];
    const uint64_t made = entry.global_key.load();
    return {made ? made : entry.group_hash & ~uint64_t{1}, entry.name,
            entry.size};
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
  // finalized, for COMM_WORLD and COMM_SELF). Its duplicate is freed at the
  // next registration, outside MPI's callback.
  static int OnFree(MPI_Comm comm, int, void* value, void*) {
    CommRegistry& registry = Get();
    std::lock_guard<std::mutex> lock(registry.mu_);
    const int64_t id = static_cast<int64_t>(reinterpret_cast<intptr_t>(value));
    if (id >= 1 && id <= static_cast<int64_t>(registry.entries_.size())) {
      Entry& entry = *registry.entries_[id - 1];
      entry.freed.store(true);
      if (entry.dup_state.load() == 2 && comm != MPI_COMM_WORLD &&
          comm != MPI_COMM_SELF) {
        registry.retired_.push_back(&entry);
      }
    }
    return MPI_SUCCESS;
  }

  // Free the duplicates of freed communicators (mu_ and the MPI lock held).
  void FreeRetired() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (Entry* entry : retired_) {
      std::lock_guard<std::mutex> lock(entry->dup_mu);
      MPI_Comm_free(&entry->dup);
      MPI_Comm_free(&entry->explain);
    }
    retired_.clear();
  }

  std::mutex mu_;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::vector<Entry*> retired_;
};

// The private duplicates of `entry`'s communicator: made on first use (every
// rank's first call on it makes them with it, as MPI requires). With `block`
// the making is waited for, polled under this thread's call deadline (the
// collective timeout); without, *ready says whether they are there yet.
inline ffi::Error PrivateComm(CommRegistry::Entry& entry, bool block,
                              MPI_Comm* dup, bool* ready, const char* who) {
  *ready = false;
  if (entry.dup_state.load(std::memory_order_acquire) == 2) {
    *dup = entry.dup;
    *ready = true;
    return ffi::Error::Success();
  }
  std::lock_guard<std::mutex> lock(entry.dup_mu);
  if (entry.dup_state.load() == 0) {
    int rc = MPI_SUCCESS;
    {
      MpiGuard guard;
      rc = MPI_Comm_idup(entry.comm, &entry.dup, &entry.dup_requests[0]);
      if (rc == MPI_SUCCESS) {
        rc = MPI_Comm_idup(entry.comm, &entry.explain, &entry.dup_requests[1]);
      }
    }
    if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_idup", rc, who);
    entry.dup_state.store(1);
  }
  if (entry.dup_state.load() == 1) {
    int rc = MPI_SUCCESS, done = 1;
    for (MPI_Request& request : entry.dup_requests) {
      if (request == MPI_REQUEST_NULL) continue;
      if (block) {
        rc = WaitRequest(&request);
      } else {
        MpiGuard guard;
        rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      }
      if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_idup", rc, who);
      if (!done) return ffi::Error::Success();
    }
    {
      MpiGuard guard;
      for (MPI_Comm comm : {entry.dup, entry.explain}) {
        MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
        MPI_Comm_set_name(comm, const_cast<char*>("mpi4jax_dist's own"));
      }
      entry.global_key.store(MadeKey(entry.group_hash));
    }
    entry.dup_state.store(2, std::memory_order_release);
  }
  *dup = entry.dup;
  *ready = true;
  return ffi::Error::Success();
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_COMM_REGISTRY_H_
