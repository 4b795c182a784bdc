// The MPI lock (mpi_guard.h): one per process, in the core.

#include "mpi_guard.h"

#include <mutex>

#include "stats.h"

namespace mpi4jax_dist {
namespace {

// Never destroyed: MPI may be called from atexit handlers.
std::mutex& Mutex() {
  static std::mutex* mutex = new std::mutex();
  return *mutex;
}

}  // namespace

bool MpiSerialized() {
  static const bool serialized = [] {
    int provided = MPI_THREAD_MULTIPLE;
    return MPI_Query_thread(&provided) == MPI_SUCCESS &&
           provided < MPI_THREAD_MULTIPLE;
  }();
  return serialized;
}

MpiGuard::MpiGuard() : lock_(Mutex(), std::defer_lock) {
  if (MpiSerialized()) {
    lock_.lock();
    GetStats().locked_sections.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace mpi4jax_dist
