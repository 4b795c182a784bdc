// What the timeline costs a call, alone (docs/timeline.rst, *What it costs*):
// Timeline::Add of 5 million events, written to FILE whenever the 4 MiB of
// memory fills, as a timed job's calls are; three times.
//
//   J=$(python -c "import jax.ffi; print(jax.ffi.include_dir())")
//   g++ -O2 -std=c++17 -Impi4jax_dist/_ffi -I"$J" -I"$(dirname "$(which mpicc)")/../include" \
//       benchmarks/timeline_add.cc mpi4jax_dist/_ffi/timeline.cc -o /tmp/timeline_add
//   /tmp/timeline_add /tmp/events.bin

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>

#include "timeline.h"

using mpi4jax_dist::Timeline;
using mpi4jax_dist::TimelineEvent;

static double NsPerAdd(Timeline& timeline, int n) {
  TimelineEvent event{};
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    event.seq = i;
    timeline.Add(event);
  }
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(end - start).count() / n;
}

int main(int argc, char** argv) {
  const int n = 5'000'000;
  const int fd = open(argc > 1 ? argv[1] : "/tmp/events.bin",
                      O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Timeline& timeline = Timeline::Get();
  for (int round = 0; round < 3; ++round) {
    timeline.Start(fd, 1 << 16);  // timeline.py's CAPACITY
    const double ns = NsPerAdd(timeline, n);
    const Timeline::Totals totals = timeline.Stop();
    std::printf("%.1f ns per call (%lld events written)\n", ns,
                static_cast<long long>(totals.written));
    lseek(fd, 0, SEEK_SET);
  }
  return 0;
}
