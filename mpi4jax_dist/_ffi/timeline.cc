// The timeline of the record's calls (timeline.h), in the core.

#include "timeline.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <mutex>

namespace mpi4jax_dist {

Timeline& Timeline::Get() {
  static Timeline* timeline = new Timeline();  // never destroyed: see Record
  return *timeline;
}

void Timeline::Start(int fd, int64_t capacity) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t size = static_cast<size_t>(std::max<int64_t>(capacity, 1));
  if (events_.size() != size) events_.assign(size, {});  // kept from a last run
  used_ = 0;
  fd_ = fd;
  totals_ = {};
  on_.store(true, std::memory_order_relaxed);
}

void Timeline::Add(const TimelineEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!on_.load(std::memory_order_relaxed)) return;  // stopped meanwhile
  events_[used_++] = event;
  if (used_ == events_.size()) FlushLocked();
}

Timeline::Totals Timeline::Stop() {
  std::lock_guard<std::mutex> lock(mu_);
  if (on_.load(std::memory_order_relaxed)) FlushLocked();
  on_.store(false, std::memory_order_relaxed);
  fd_ = -1;
  return totals_;
}

void Timeline::FlushLocked() {
  const char* data = reinterpret_cast<const char*>(events_.data());
  const size_t bytes = used_ * sizeof(TimelineEvent);
  size_t done = 0;
  while (done < bytes && totals_.error == 0) {
    const ssize_t n = ::write(fd_, data + done, bytes - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      totals_.error = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  // Whole events only: a write cut short loses the rest of this batch.
  const int64_t whole = static_cast<int64_t>(done / sizeof(TimelineEvent));
  totals_.written += whole;
  totals_.lost += static_cast<int64_t>(used_) - whole;
  used_ = 0;
}

}  // namespace mpi4jax_dist
