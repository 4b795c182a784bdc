// The communicator registry (comm_registry.h), in the core: one a process.

#include "comm_registry.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mpi_guard.h"
#include "timeout.h"

namespace mpi4jax_dist {
namespace {

// A communicator's group as every member of it names it alike: FNV-1a of its
// ranks in MPI_COMM_WORLD and their number, never 0. O(P), once per
// communicator. Called with the MPI lock held.
uint64_t GroupHash(MPI_Comm comm) {
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
uint64_t MadeKey(uint64_t group_hash) {
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

}  // namespace

CommRegistry& CommRegistry::Get() {
  static CommRegistry* registry = new CommRegistry();
  return *registry;
}

ffi::Error CommRegistry::Register(int64_t handle, int64_t* id,
                                  const char* who) {
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

ffi::Error CommRegistry::Find(int64_t id, Entry** out, const char* who) {
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

int64_t CommRegistry::CountCall(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_[id - 1]->calls.fetch_add(1) + 1;
}

CommRegistry::Description CommRegistry::Describe(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 1 || id > static_cast<int64_t>(entries_.size())) return {};
  const Entry& entry = *entries_[id - 1];
  const uint64_t made = entry.global_key.load();
  return {made ? made : entry.group_hash & ~uint64_t{1}, entry.name,
          entry.size};
}

std::vector<int64_t> CommRegistry::CallCounts() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> counts;
  for (const auto& entry : entries_) counts.push_back(entry->calls.load());
  return counts;
}

int CommRegistry::OnFree(MPI_Comm comm, int, void* value, void*) {
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

void CommRegistry::FreeRetired() {
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

// The private duplicates of `entry`'s communicator: made on first use (every
// rank's first call on it makes them with it, as MPI requires). With `block`
// the making is waited for, polled under this thread's call deadline (the
// collective timeout); without, *ready says whether they are there yet.
ffi::Error PrivateComm(CommRegistry::Entry& entry, bool block, MPI_Comm* dup,
                       bool* ready, const char* who) {
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
        rc = WaitRequest(&request, 0);  // a communicator's duplication
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
