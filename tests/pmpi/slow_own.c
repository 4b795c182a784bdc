/* A PMPI interposer for tests/jobs/test_standstill.py: the package's own reductions
 * (on the communicators it names "mpi4jax_dist's own") start SLOW_OWN_S
 * seconds late, so that every rank waits in a call that MPI completes: a long
 * transfer, which no check may take for ranks that cannot go on. Every other
 * MPI call (the watchdog's among them) goes straight to the library. */

#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int own(MPI_Comm comm) {
  char name[MPI_MAX_OBJECT_NAME];
  int length = 0;
  if (PMPI_Comm_get_name(comm, name, &length) != MPI_SUCCESS) return 0;
  return strcmp(name, "mpi4jax_dist's own") == 0;
}

static void late(MPI_Comm comm) {
  const char* seconds = getenv("SLOW_OWN_S");
  if (seconds == NULL || !own(comm)) return;
  double s = atof(seconds);
  struct timespec wait = {(time_t)s, (long)((s - (time_t)s) * 1e9)};
  nanosleep(&wait, NULL);
}

int MPI_Allreduce(const void* send, void* recv, int count, MPI_Datatype type,
                  MPI_Op op, MPI_Comm comm) {
  late(comm);
  return PMPI_Allreduce(send, recv, count, type, op, comm);
}

int MPI_Iallreduce(const void* send, void* recv, int count, MPI_Datatype type,
                   MPI_Op op, MPI_Comm comm, MPI_Request* request) {
  late(comm);
  return PMPI_Iallreduce(send, recv, count, type, op, comm, request);
}
