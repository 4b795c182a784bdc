/* A PMPI interposer that gives every allreduce the latency of a large machine
 * (benchmarks/_latency.py builds it with the MPI's compiler wrapper and preloads
 * it): each reduction's result is held until `delay` microseconds after its post.
 * MPI_Allreduce(_c) returns no sooner; MPI_Iallreduce(_c) notes the post; MPI_Test
 * on such a request says incomplete until then (MPI_Request_get_status still
 * progresses it); MPI_Wait returns no sooner. A blocking reduction so pays the
 * delay, an overlapped one what its overlapped work does not cover. The delay,
 * 0 at first, is set between measurements by pmpi_latency_set_us() (ctypes).
 */

#include <mpi.h>
#include <pthread.h>
#include <string.h>

#define SLOTS 8192

static double delay_s = 0.0;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  MPI_Request request;
  double ready; /* MPI_Wtime at which the result may be seen */
  int used;
} held[SLOTS];

__attribute__((visibility("default"))) void pmpi_latency_set_us(double us) {
  delay_s = us > 0 ? us * 1e-6 : 0.0;
}

__attribute__((visibility("default"))) double pmpi_latency_us(void) {
  return delay_s * 1e6;
}

static void spin_until(double t) {
  while (PMPI_Wtime() < t) {
  }
}

/* Note a posted reduction: in the slot of an earlier request with the same
 * handle (MPI reuses freed handles; one completed by a call not interposed here
 * was never released), else in a free one. */
static void hold(MPI_Request request, double posted) {
  if (delay_s <= 0 || request == MPI_REQUEST_NULL) return;
  pthread_mutex_lock(&lock);
  int slot = -1;
  for (int i = 0; i < SLOTS; ++i) {
    if (held[i].used &&
        memcmp(&held[i].request, &request, sizeof request) == 0) {
      slot = i;
      break;
    }
    if (!held[i].used && slot < 0) slot = i;
  }
  if (slot >= 0) {
    held[slot].request = request;
    held[slot].ready = posted + delay_s;
    held[slot].used = 1;
  }
  pthread_mutex_unlock(&lock);
}

/* When the held request may complete (0: not held); with `release`, forget it. */
static double ready_time(MPI_Request request, int release) {
  double ready = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < SLOTS; ++i) {
    if (held[i].used &&
        memcmp(&held[i].request, &request, sizeof request) == 0) {
      ready = held[i].ready;
      if (release) held[i].used = 0;
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  return ready;
}

int MPI_Allreduce(const void* in, void* out, int count, MPI_Datatype type,
                  MPI_Op op, MPI_Comm comm) {
  double start = PMPI_Wtime();
  int rc = PMPI_Allreduce(in, out, count, type, op, comm);
  spin_until(start + delay_s);
  return rc;
}

int MPI_Iallreduce(const void* in, void* out, int count, MPI_Datatype type,
                   MPI_Op op, MPI_Comm comm, MPI_Request* request) {
  double posted = PMPI_Wtime();
  int rc = PMPI_Iallreduce(in, out, count, type, op, comm, request);
  if (rc == MPI_SUCCESS) hold(*request, posted);
  return rc;
}

#if MPI_VERSION >= 4
int MPI_Allreduce_c(const void* in, void* out, MPI_Count count,
                    MPI_Datatype type, MPI_Op op, MPI_Comm comm) {
  double start = PMPI_Wtime();
  int rc = PMPI_Allreduce_c(in, out, count, type, op, comm);
  spin_until(start + delay_s);
  return rc;
}

int MPI_Iallreduce_c(const void* in, void* out, MPI_Count count,
                     MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                     MPI_Request* request) {
  double posted = PMPI_Wtime();
  int rc = PMPI_Iallreduce_c(in, out, count, type, op, comm, request);
  if (rc == MPI_SUCCESS) hold(*request, posted);
  return rc;
}
#endif

int MPI_Test(MPI_Request* request, int* flag, MPI_Status* status) {
  MPI_Request mine = *request;
  double ready = ready_time(mine, 0);
  if (ready > 0 && PMPI_Wtime() < ready) {
    /* Progress it, but do not complete (and free) it before its time. */
    int done = 0;
    int rc = PMPI_Request_get_status(mine, &done, MPI_STATUS_IGNORE);
    *flag = 0;
    return rc;
  }
  int rc = PMPI_Test(request, flag, status);
  if (ready > 0 && *flag) ready_time(mine, 1);
  return rc;
}

int MPI_Wait(MPI_Request* request, MPI_Status* status) {
  MPI_Request mine = *request;
  double ready = ready_time(mine, 1);
  int rc = PMPI_Wait(request, status);
  if (ready > 0) spin_until(ready);
  return rc;
}
