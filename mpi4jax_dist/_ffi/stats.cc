// What the handlers did (stats.h): the counts, in the core.

#include "stats.h"

#include <atomic>
#include <cstdint>

namespace mpi4jax_dist {

void Stats::Reset() {
  handler_calls = 0;
  same_buffer_calls = 0;
  mpi_calls = 0;
  large_count_calls = 0;
  max_call_count = 0;
  locked_sections = 0;
}

Stats& GetStats() {
  static Stats stats;
  return stats;
}

StatsItems GetStatsItems() {
  const Stats& s = GetStats();
  return {
      {"handler_calls", s.handler_calls.load()},
      {"same_buffer_calls", s.same_buffer_calls.load()},
      {"mpi_calls", s.mpi_calls.load()},
      {"large_count_calls", s.large_count_calls.load()},
      {"max_call_count", s.max_call_count.load()},
      {"locked_sections", s.locked_sections.load()},
  };
}

void CountHandlerCall(const void* operand, const void* result) {
  Stats& stats = GetStats();
  stats.handler_calls.fetch_add(1, std::memory_order_relaxed);
  if (operand == result) {
    stats.same_buffer_calls.fetch_add(1, std::memory_order_relaxed);
  }
}

void RequestStats::Reset() {
  starts = 0;
  large_count_starts = 0;
  waits = 0;
  done_before_wait = 0;
  wait_slack_ns = 0;
  wait_blocked_ns = 0;
  tests = 0;
  tests_done = 0;
  max_pending = 0;
}

RequestStats& GetRequestStats() {
  static RequestStats stats;
  return stats;
}

StatsItems GetRequestStatsItems() {
  const RequestStats& r = GetRequestStats();
  return {
      {"iallreduce_starts", r.starts.load()},
      {"iallreduce_large_count_starts", r.large_count_starts.load()},
      {"iallreduce_waits", r.waits.load()},
      {"iallreduce_done_before_wait", r.done_before_wait.load()},
      {"iallreduce_wait_slack_ns", r.wait_slack_ns.load()},
      {"iallreduce_wait_blocked_ns", r.wait_blocked_ns.load()},
      {"iallreduce_tests", r.tests.load()},
      {"iallreduce_tests_done", r.tests_done.load()},
      {"iallreduce_max_pending", r.max_pending.load()},
  };
}

}  // namespace mpi4jax_dist
