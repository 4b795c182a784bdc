// The MPI lock. Under MPI_THREAD_SERIALIZED (Cray MPICH's default) every MPI
// call of the handlers, and of Python's calls into the modules, is made holding
// one process-wide lock (MpiGuard); under MPI_THREAD_MULTIPLE nothing is held.
// The level is read once, at the first guarded call, when MPI is up.

#ifndef MPI4JAX_DIST_FFI_MPI_GUARD_H_
#define MPI4JAX_DIST_FFI_MPI_GUARD_H_

#include <mutex>

#include "mpi_base.h"

namespace mpi4jax_dist {

// Whether MPI provides less than MPI_THREAD_MULTIPLE. Every caller has checked
// that MPI is up (CheckMpiUsable): MPI_Query_thread may then be called from any
// thread. The user's own mpi4py calls do not take the lock: they must not
// overlap a running jitted program (as with mpi4jax).
MPI4JAX_DIST_CORE_API bool MpiSerialized();

// Holds the MPI lock for its scope where MPI is serialized; nothing otherwise.
// Lock order: a table's own mutex (RequestTable, CommRegistry) may be held when
// this is taken, never the other way round.
class MPI4JAX_DIST_CORE_API MpiGuard {
 public:
  MpiGuard();

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MPI_GUARD_H_
