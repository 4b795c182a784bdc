// The record of the collectives this process runs (record.h), in the core.

#include "record.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "timeline.h"
#include "timeout.h"

namespace mpi4jax_dist {

const char* KindName(int32_t kind) {
  return kind == kNonBlocking ? "iallreduce" : "allreduce";
}

namespace {

// The reduction ops by the code the Python side gives them (ops/common.py's
// OPS, op_dtype.h's OpFromCode).
const char* const kOpNames[] = {"SUM",  "PROD", "MIN", "MAX",  "LAND",
                                "LOR",  "LXOR", "BAND", "BOR", "BXOR"};
constexpr int32_t kOps = sizeof kOpNames / sizeof kOpNames[0];

// The XLA element types the ops take, as NumPy names them.
const struct {
  ffi::DataType type;
  const char* name;
} kTypeNames[] = {
    {ffi::DataType::PRED, "bool"},        {ffi::DataType::S8, "int8"},
    {ffi::DataType::S16, "int16"},        {ffi::DataType::S32, "int32"},
    {ffi::DataType::S64, "int64"},        {ffi::DataType::U8, "uint8"},
    {ffi::DataType::U16, "uint16"},       {ffi::DataType::U32, "uint32"},
    {ffi::DataType::U64, "uint64"},       {ffi::DataType::F32, "float32"},
    {ffi::DataType::F64, "float64"},      {ffi::DataType::C64, "complex64"},
    {ffi::DataType::C128, "complex128"},
};

}  // namespace

const char* OpName(int32_t code) {
  return code >= 0 && code < kOps ? kOpNames[code] : "?";
}

int32_t OpFromName(const char* name) {
  for (int32_t code = 0; name != nullptr && code < kOps; ++code) {
    if (std::strcmp(kOpNames[code], name) == 0) return code;
  }
  return -1;
}

const char* TypeName(int32_t type) {
  for (const auto& known : kTypeNames) {
    if (static_cast<int32_t>(known.type) == type) return known.name;
  }
  return "?";
}

int32_t TypeFromName(const char* name) {
  for (const auto& known : kTypeNames) {
    if (name != nullptr && std::strcmp(known.name, name) == 0)
      return static_cast<int32_t>(known.type);
  }
  return 0;
}

// "allreduce #5 SUM float32[4]": a call as the reports name it.
std::string CallText(int32_t kind, int64_t seq, int32_t op, int32_t type,
                     int64_t count) {
  char text[160];
  std::snprintf(text, sizeof text, "%s #%lld %s %s[%lld]", KindName(kind),
                static_cast<long long>(seq), OpName(op), TypeName(type),
                static_cast<long long>(count));
  return text;
}

Record& Record::Get() {
  static Record* record = new Record();
  return *record;
}

Record::Handle Record::Enter(int64_t comm_id, int64_t seq, int32_t kind,
                             int32_t op, int32_t type, int64_t count,
                             int64_t site, int64_t now_ns,
                             const char* comm_name, CallState state) {
  const int64_t serial = next_.fetch_add(1, std::memory_order_relaxed) + 1;
  Entry& e = entries_[(serial - 1) % kEntries];
  e.serial.store(0, std::memory_order_relaxed);  // torn while written
  e.comm_id = comm_id;
  e.seq = seq;
  e.count = count;
  e.site = site;
  e.entered_ns = now_ns;
  e.waited_ns = now_ns;
  e.kind = kind;
  e.op = op;
  e.type = type;
  e.comm_name = comm_name;
  e.state.store(state, std::memory_order_relaxed);
  e.serial.store(serial, std::memory_order_release);
  if (serial == 1) first_ns_.store(now_ns, std::memory_order_relaxed);
  Touch(now_ns);
  return {&e, serial};
}

void Record::Finish(const Handle& handle, CallState state) {
  const int64_t now_ns = SetState(handle, state);
  const Entry* e = Live(handle);
  if (e == nullptr) return;
  Get().blocked_ns_.fetch_add(now_ns - e->waited_ns, std::memory_order_relaxed);
  Timeline& timeline = Timeline::Get();
  if (!timeline.On()) return;
  timeline.Add({e->entered_ns, e->waited_ns, now_ns, e->comm_id, e->seq,
                e->count, e->site, e->kind, static_cast<uint8_t>(e->op),
                static_cast<uint8_t>(e->type), static_cast<uint8_t>(state), 0});
}

void Record::Waiting(const Handle& handle) {
  const int64_t now_ns = SetState(handle, kEntered);
  if (Entry* e = Live(handle)) e->waited_ns = now_ns;
}

int64_t Record::RegisterSite(const std::string& text,
                             const std::string& compared) {
  const int64_t key = SiteKey(compared);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t known = published_.load(std::memory_order_relaxed);
  for (int64_t i = 0; i < known; ++i) {
    if (keys_[i] == key && *sites_[i].load(std::memory_order_relaxed) == text)
      return i + 1;
  }
  if (known >= kSites) return -key;
  keys_[known] = key;
  sites_[known].store(new std::string(text), std::memory_order_relaxed);
  published_.store(known + 1, std::memory_order_release);
  return known + 1;
}

const char* Record::Site(int64_t id) const {
  if (id < 1 || id > published_.load(std::memory_order_acquire)) return "";
  return sites_[id - 1].load(std::memory_order_relaxed)->c_str();
}

int64_t Record::Key(int64_t id) const {
  if (id < 0) return -id;
  if (id < 1 || id > published_.load(std::memory_order_acquire)) return 0;
  return keys_[id - 1];
}

int64_t Record::SiteKey(std::string_view compared) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : compared) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  const int64_t key = static_cast<int64_t>(hash & INT64_MAX);
  return key != 0 ? key : 1;
}

std::vector<Record::Copy> Record::Entries() const {
  std::vector<Copy> out;
  const int64_t last = next_.load(std::memory_order_acquire);
  for (int64_t s = std::max<int64_t>(1, last - kEntries + 1); s <= last; ++s) {
    const Entry& e = entries_[(s - 1) % kEntries];
    if (e.serial.load(std::memory_order_acquire) != s) continue;  // torn
    out.push_back({s, e.comm_id, e.seq, e.count, e.site, e.entered_ns,
                   e.waited_ns, e.kind, e.op, e.type,
                   e.state.load(std::memory_order_acquire), e.comm_name});
  }
  return out;
}

Record::Totals Record::Sums(int64_t now_ns) const {
  Totals totals{next_.load(std::memory_order_relaxed),
                blocked_ns_.load(std::memory_order_relaxed),
                first_ns_.load(std::memory_order_relaxed)};
  for (const Copy& e : Entries()) {
    if (e.state == kEntered)
      totals.blocked_ns += std::max<int64_t>(0, now_ns - e.waited_ns);
  }
  return totals;
}

size_t Record::InFlightText(char* out, size_t capacity) const {
  if (capacity == 0) return 0;
  size_t used = 0;
  out[0] = '\0';
  for (const Copy& e : Entries()) {
    if (e.state != kEntered && e.state != kPosted) continue;
    const char* site = Site(e.site);
    const int n = std::snprintf(
        out + used, capacity - used, "%s%s%s%s%s%s%s", used ? "; " : "",
        CallText(e.kind, e.seq, e.op, e.type, e.count).c_str(),
        e.comm_name[0] ? " on " : "", e.comm_name, site[0] ? " at " : "", site,
        e.state == kPosted ? " (started, not waited for)" : "");
    if (n < 0) break;
    used = std::min(capacity - 1, used + static_cast<size_t>(n));
  }
  return used;
}

Record::Entry* Record::Live(const Handle& handle) {
  if (handle.entry == nullptr ||
      handle.entry->serial.load(std::memory_order_acquire) != handle.serial) {
    return nullptr;
  }
  return handle.entry;
}

int64_t Record::SetState(const Handle& handle, CallState state) {
  if (Entry* e = Live(handle)) e->state.store(state, std::memory_order_release);
  const int64_t now_ns = SteadyNs();
  Get().Touch(now_ns);
  return now_ns;
}

void Record::Touch(int64_t now_ns) {
  events_.fetch_add(1, std::memory_order_relaxed);
  last_event_ns_.store(now_ns, std::memory_order_relaxed);
}

}  // namespace mpi4jax_dist

extern "C" size_t mpi4jax_dist_in_flight(char* out, size_t capacity) {
  return mpi4jax_dist::Record::Get().InFlightText(out, capacity);
}

extern "C" void mpi4jax_dist_totals(int64_t out[3]) {
  const mpi4jax_dist::Record::Totals totals =
      mpi4jax_dist::Record::Get().Sums(mpi4jax_dist::SteadyNs());
  out[0] = totals.entered;
  out[1] = totals.blocked_ns;
  out[2] = totals.first_ns;
}
