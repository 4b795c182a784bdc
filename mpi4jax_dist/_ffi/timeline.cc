// The timeline of the record's calls (timeline.h), in the core.

#include "timeline.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <mutex>
#include <string>

#include "record.h"

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

namespace {

// The kinds and communicators of XLA's calls met so far (XlaNames).
struct XlaTables {
  std::mutex mu;
  std::vector<const char*> calls;  // the wrapper's static names
  XlaTimelineNames names;
  std::atomic<int64_t> site{0};
};

XlaTables& Xla() {
  static XlaTables* tables = new XlaTables();  // never destroyed: see Record
  return *tables;
}

}  // namespace

XlaTimelineNames XlaNames() {
  XlaTables& xla = Xla();
  std::lock_guard<std::mutex> lock(xla.mu);
  return xla.names;
}

}  // namespace mpi4jax_dist

extern "C" int mpi4jax_dist_timeline_on(void) {
  return mpi4jax_dist::Timeline::Get().On() ? 1 : 0;
}

extern "C" void mpi4jax_dist_timeline_add_mpi(int64_t enter_ns, int64_t leave_ns,
                                              int64_t comm_index,
                                              int64_t comm_size, int64_t seq,
                                              int64_t count, const char* call,
                                              const char* op, const char* type) {
  using namespace mpi4jax_dist;
  Timeline& timeline = Timeline::Get();
  if (!timeline.On() || comm_index < 0 || call == nullptr) return;
  XlaTables& xla = Xla();
  int32_t kind = 0;
  {
    std::lock_guard<std::mutex> lock(xla.mu);
    size_t i = 0;
    while (i < xla.calls.size() && xla.calls[i] != call) ++i;
    if (i == xla.calls.size()) {
      xla.calls.push_back(call);
      xla.names.kinds.emplace_back(call);
    }
    kind = kFirstXlaKind + static_cast<int32_t>(i);
    auto& sizes = xla.names.comm_sizes;
    if (sizes.size() <= static_cast<size_t>(comm_index))
      sizes.resize(static_cast<size_t>(comm_index) + 1, 0);
    sizes[static_cast<size_t>(comm_index)] = static_cast<int>(comm_size);
  }
  int64_t site = xla.site.load(std::memory_order_acquire);
  if (site == 0) {
    site = Record::Get().RegisterSite(kXlaSite, kXlaSite);
    xla.site.store(site, std::memory_order_release);
  }
  timeline.Add({enter_ns, enter_ns, leave_ns, -1 - comm_index, seq, count, site,
                kind, static_cast<uint8_t>(OpFromName(op)),  // -1: 255, none
                static_cast<uint8_t>(TypeFromName(type)), kDone, 0});
}
