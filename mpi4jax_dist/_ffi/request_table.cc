// The non-blocking allreduce's requests in flight (request_table.h), in the
// core.

#include "request_table.h"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "mpi_guard.h"
#include "stats.h"
#include "timeout.h"

namespace mpi4jax_dist {

RequestTable& RequestTable::Get() {
  static RequestTable* table = new RequestTable();
  return *table;
}

ffi::Error RequestTable::Take(int64_t uid, std::string_view site,
                              const void* operand, size_t bytes, size_t offset,
                              size_t padding, int64_t posted_ns,
                              const std::function<int(PendingRequest*)>& post,
                              int* rc, int32_t* handle) {
  std::lock_guard<std::mutex> lock(mu_);
  PendingRequest* free = nullptr;
  size_t index = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    PendingRequest& s = *slots_[i];
    if (s.active && uid != 0 && s.uid == uid) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          std::string(kIallreduceName) + ": the start made at " +
              std::string(site) +
              " runs again while its previous request is still pending: "
              "its req.wait() did not run (is it in a branch that was "
              "not taken, or was the request kept out of the function?). "
              "Every start needs its wait, on every run.");
    }
    if (!s.active && free == nullptr) {
      free = &s;
      index = i;
    }
  }
  if (free == nullptr) {
    if (slots_.size() >= static_cast<size_t>(kMaxRequests)) {
      return ffi::Error(
          ffi::ErrorCode::kResourceExhausted,
          std::string(kIallreduceName) + ": " + std::to_string(kMaxRequests) +
              " requests are pending, none waited on; the start made at " +
              std::string(site) +
              " is refused. Waits are missing: every start needs its "
              "req.wait().");
    }
    slots_.push_back(std::make_unique<PendingRequest>());
    free = slots_.back().get();
    index = slots_.size() - 1;
  }
  const size_t size = offset + bytes + padding;
  if (free->capacity < size) {
    // Uninitialized: the copy below and the header fill what MPI reduces
    // (the padding is sent as it is, never read).
    free->data.reset(new (std::nothrow) char[size]);
    free->capacity = free->data ? size : 0;
    if (!free->data) {
      return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                        std::string(kIallreduceName) +
                            ": no memory for the " + std::to_string(bytes) +
                            " bytes MPI reduces into (the start made at " +
                            std::string(site) + ")");
    }
  }
  if (bytes > 0) std::memcpy(free->data.get() + offset, operand, bytes);
  free->request = MPI_REQUEST_NULL;
  free->agreement = MPI_REQUEST_NULL;
  free->offset = offset;
  free->setup = false;
  free->deferred = false;
  free->header_rc = MPI_SUCCESS;
  {
    MpiGuard guard;  // after mu_: see MpiGuard's lock order
    *rc = post(free);
  }
  if (*rc != MPI_SUCCESS) return ffi::Error::Success();  // nothing taken
  free->bytes = bytes;
  free->comm_id = CurrentCall().comm_id;
  free->seq = CurrentCall().call;
  free->uid = uid;
  free->posted_ns = posted_ns;
  free->site.assign(site.data(), site.size());
  free->generation = free->generation % kMaxGeneration + 1;
  free->active = true;
  *handle = free->generation * kMaxRequests + static_cast<int32_t>(index);
  ++active_;
  RequestStats& stats = GetRequestStats();
  int64_t seen = stats.max_pending.load(std::memory_order_relaxed);
  while (active_ > seen && !stats.max_pending.compare_exchange_weak(
                               seen, active_, std::memory_order_relaxed)) {
  }
  return ffi::Error::Success();
}

ffi::Error RequestTable::Find(int32_t handle, const char* who,
                              PendingRequest** slot) {
  std::lock_guard<std::mutex> lock(mu_);
  const int32_t index = handle % kMaxRequests;
  const int32_t generation = handle / kMaxRequests;
  if (handle > 0 && static_cast<size_t>(index) < slots_.size() &&
      slots_[index]->active && slots_[index]->generation == generation) {
    *slot = slots_[index].get();
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument(
      std::string(who) + ": request handle " + std::to_string(handle) +
      " is not pending: it was waited on already, or comes from another run "
      "(a request cannot leave the function that started it).");
}

void RequestTable::Free(PendingRequest* slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot->active) --active_;
  slot->active = false;
  slot->request = MPI_REQUEST_NULL;
  slot->agreement = MPI_REQUEST_NULL;
  // Small memory stays for the next start; large goes back.
  if (slot->capacity > kKeepBytes) {
    slot->data.reset();
    slot->capacity = 0;
  }
}

void RequestTable::Abandon(PendingRequest* slot) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    (void)slot->data.release();  // NOLINT: MPI may still write into it
    slot->capacity = 0;
  }
  Free(slot);
}

std::vector<RequestTable::Info> RequestTable::Pending() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Info> pending;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const PendingRequest& s = *slots_[i];
    if (s.active) {
      pending.push_back(
          {s.generation * kMaxRequests + static_cast<int32_t>(i), s.uid,
           s.site});
    }
  }
  return pending;
}

}  // namespace mpi4jax_dist
