/* The world XLA sees, in the MPIABI wrapper (mpiabi.h).
 *
 * XLA makes its communicators with MPI_Comm_split(MPI_COMM_WORLD, ...) from its
 * worker threads, lazily, while the program's main thread may be in a collective
 * of its own on MPI_COMM_WORLD (mpi4py's, mpi4jax's): MPI forbids two threads to
 * call collectives on one communicator at once, and asks every rank to call them
 * in one order. mpi4jax_dist's bootstrap, which every rank runs at one point of
 * its program, duplicates the world and hands the duplicate over here
 * (mpi4jax_dist_mpiabi_set_world); from then on XLA's MPI_COMM_WORLD is that
 * duplicate, on which nothing else runs. Before it (a wrapper used without
 * mpi4jax_dist's bootstrap), XLA gets the world itself, as MPItrampoline's own
 * wrapper would give it. */

#include <mpi.h>

#include <stdint.h>

#include "mpiabi.h"

static MPI_Comm xla_world = MPI_COMM_NULL;
/* Calls in which XLA passed MPI_COMM_WORLD and got the duplicate: what
 * --check --json reports (xla_mpi.report()'s xla_world_redirects). */
static unsigned long long world_redirects = 0;

/* Set XLA's world (a native handle, congruent to MPI_COMM_WORLD); once, before
 * XLA's first collective. Returns MPI_SUCCESS, or MPI_ERR_COMM for a
 * communicator that is not the whole world, or for a second call. */
MPIABI_API int mpi4jax_dist_mpiabi_set_world(uintptr_t world) {
  int result = MPI_UNEQUAL;
  if (xla_world != MPI_COMM_NULL ||
      MPI_Comm_compare(MPI_COMM_WORLD, (MPI_Comm)world, &result) !=
          MPI_SUCCESS ||
      result != MPI_CONGRUENT)
    return MPI_ERR_COMM;
  xla_world = (MPI_Comm)world;
  return MPI_SUCCESS;
}

/* XLA's world now (a native handle), and how often it was handed out. */
MPIABI_API uintptr_t mpi4jax_dist_mpiabi_world(void) {
  return (uintptr_t)(xla_world != MPI_COMM_NULL ? xla_world : MPI_COMM_WORLD);
}

MPIABI_API unsigned long long mpi4jax_dist_mpiabi_world_redirects(void) {
  return __atomic_load_n(&world_redirects, __ATOMIC_RELAXED);
}

/* The native communicator for an ABI handle XLA passes in. */
MPI_Comm comm_in(uintptr_t comm) {
  if ((MPI_Comm)comm == MPI_COMM_WORLD && xla_world != MPI_COMM_NULL) {
    __atomic_fetch_add(&world_redirects, 1, __ATOMIC_RELAXED);
    return xla_world;
  }
  return (MPI_Comm)comm;
}

