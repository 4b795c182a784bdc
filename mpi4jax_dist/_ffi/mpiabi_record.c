/* The record of XLA's calls, in the MPIABI wrapper (mpiabi.h).
 *
 * The hang reports say which collective a rank is in; for XLA's collectives over
 * MPI the Python frame says only "the jitted call", so the wrapper keeps a ring
 * of the last RECORD_ENTRIES calls into MPI that can wait on other ranks (their
 * name, number on their communicator, op, element type and count, and whether
 * they returned), read by mpi4jax_dist_mpiabi_in_flight, from Python (xla_mpi)
 * and from _stacks's C thread for a rank whose Python cannot run. Plain stores
 * into fixed memory: no allocation and no lock per call, but the communicators'
 * numbering, under a mutex (XLA's worker threads may call at once). The
 * extensions keep their own record of their collectives (record.h). */

#include <mpi.h>

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "mpiabi.h"

#define RECORD_ENTRIES 64
#define RECORD_COMMS 64

enum { kEntered = 1, kReturned = 2 };

typedef struct {
  unsigned long long serial; /* 0 while written; else 1, 2, ... */
  const char *call;          /* "MPI_Allreduce" */
  const char *op;            /* "SUM", or NULL */
  const char *type;          /* "float32", or NULL */
  long long count;           /* elements; -1: none to say */
  long long seq;             /* the call's number on its communicator; 0: none */
  int size;                  /* the communicator's size; 0: none */
  int peer;                  /* a point-to-point call's other rank; -1: none */
  int state;
  int comm_index;            /* its communicator in record_comms; -1: none */
  long long enter_ns;        /* entered, where the timeline is on; else 0 */
} RecordEntry;

static RecordEntry record_entries[RECORD_ENTRIES];
static unsigned long long record_next = 0;

/* Per communicator: how many recorded calls ran on it (the numbers agree between
 * ranks as long as they call the same collectives in one order, as MPI asks). */
static struct {
  MPI_Comm comm;
  long long calls;
  int size;
} record_comms[RECORD_COMMS];
static int record_known = 0;
static pthread_mutex_t record_mu = PTHREAD_MUTEX_INITIALIZER;

/* Forget a communicator about to be freed: MPI may give its handle to the
 * next one made. */
void record_forget(MPI_Comm comm) {
  pthread_mutex_lock(&record_mu);
  for (int i = 0; i < record_known; ++i) {
    if (record_comms[i].comm == comm) {
      record_comms[i] = record_comms[--record_known];
      break;
    }
  }
  pthread_mutex_unlock(&record_mu);
}

/* The timeline's functions in the core (timeline.h), handed over by
 * mpi4jax_dist_mpiabi_time_calls; NULL until then. */
static int (*timeline_on)(void);
static void (*timeline_add)(int64_t enter_ns, int64_t leave_ns,
                            int64_t comm_index, int64_t comm_size, int64_t seq,
                            int64_t count, const char *call, const char *op,
                            const char *type);

/* Time XLA's collectives into the timeline while one is written: `on` and `add`
 * are the core's mpi4jax_dist_timeline_on and mpi4jax_dist_timeline_add_mpi
 * (xla_mpi.time_calls hands them over once). */
MPIABI_API void mpi4jax_dist_mpiabi_time_calls(void *on, void *add) {
  __atomic_store_n(&timeline_add, (__typeof__(timeline_add))add,
                   __ATOMIC_RELEASE);
  __atomic_store_n(&timeline_on, (__typeof__(timeline_on))on, __ATOMIC_RELEASE);
}

static long long monotonic_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The next number on `comm`, its size and its index in record_comms; 0, 0 and
 * -1 past RECORD_COMMS communicators (XLA keeps a few, one per group of ranks
 * it reduces over). */
static long long record_number(MPI_Comm comm, int *size, int *index) {
  long long seq = 0;
  *size = 0;
  *index = -1;
  pthread_mutex_lock(&record_mu);
  int i = 0;
  while (i < record_known && record_comms[i].comm != comm) ++i;
  if (i == record_known && i < RECORD_COMMS) {
    record_comms[i].comm = comm;
    record_comms[i].calls = 0;
    if (MPI_Comm_size(comm, &record_comms[i].size) != MPI_SUCCESS)
      record_comms[i].size = 0;
    record_known = i + 1;
  }
  if (i < record_known) {
    seq = ++record_comms[i].calls;
    *size = record_comms[i].size;
    *index = i;
  }
  pthread_mutex_unlock(&record_mu);
  return seq;
}

const char *type_name(MPI_Datatype type) {
  if (type == MPI_FLOAT) return "float32";
  if (type == MPI_DOUBLE) return "float64";
  if (type == MPI_INT8_T) return "int8";
  if (type == MPI_INT16_T) return "int16";
  if (type == MPI_INT32_T || type == MPI_INT) return "int32";
  if (type == MPI_INT64_T || type == MPI_LONG_LONG) return "int64";
  if (type == MPI_UINT8_T) return "uint8";
  if (type == MPI_UINT16_T) return "uint16";
  if (type == MPI_UINT32_T) return "uint32";
  if (type == MPI_UINT64_T) return "uint64";
  if (type == MPI_C_BOOL) return "bool";
  if (type == MPI_C_FLOAT_COMPLEX) return "complex64";
  if (type == MPI_C_DOUBLE_COMPLEX) return "complex128";
  if (type == MPI_BYTE || type == MPI_CHAR) return "bytes";
  return "?";
}

const char *op_name(MPI_Op op) {
  if (op == MPI_SUM) return "SUM";
  if (op == MPI_PROD) return "PROD";
  if (op == MPI_MIN) return "MIN";
  if (op == MPI_MAX) return "MAX";
  if (op == MPI_LAND) return "LAND";
  if (op == MPI_LOR) return "LOR";
  if (op == MPI_LXOR) return "LXOR";
  if (op == MPI_BAND) return "BAND";
  if (op == MPI_BOR) return "BOR";
  if (op == MPI_BXOR) return "BXOR";
  return "?";
}

/* Write a call entering MPI; return its serial, for record_return. A
 * collective passes its communicator, numbered there; a point-to-point call
 * MPI_COMM_NULL and its peer (its numbers would differ between ranks that do
 * not all send), MPI_Wait neither. */
unsigned long long record_enter(const char *call, MPI_Comm comm, int peer,
                                const char *op, const char *type,
                                long long count) {
  int size = 0, index = -1;
  const long long seq =
      comm == MPI_COMM_NULL ? 0 : record_number(comm, &size, &index);
  int (*on)(void) = __atomic_load_n(&timeline_on, __ATOMIC_ACQUIRE);
  const unsigned long long serial =
      __atomic_add_fetch(&record_next, 1, __ATOMIC_RELAXED);
  RecordEntry *e = &record_entries[(serial - 1) % RECORD_ENTRIES];
  __atomic_store_n(&e->serial, 0, __ATOMIC_RELAXED); /* torn while written */
  e->call = call;
  e->op = op;
  e->type = type;
  e->count = count;
  e->seq = seq;
  e->size = size;
  e->peer = peer;
  e->comm_index = index;
  e->enter_ns = seq && on != NULL && on() ? monotonic_ns() : 0;
  __atomic_store_n(&e->state, kEntered, __ATOMIC_RELAXED);
  __atomic_store_n(&e->serial, serial, __ATOMIC_RELEASE);
  return serial;
}

/* Mark call `serial` returned, unless a later call took its entry over; a
 * collective timed at its entry goes onto the timeline. */
void record_return(unsigned long long serial) {
  RecordEntry *e = &record_entries[(serial - 1) % RECORD_ENTRIES];
  if (__atomic_load_n(&e->serial, __ATOMIC_ACQUIRE) != serial)
    return;
  __atomic_store_n(&e->state, kReturned, __ATOMIC_RELEASE);
  if (e->enter_ns == 0)
    return;
  const long long leave_ns = monotonic_ns();
  const RecordEntry copy = *e; /* then checked whole: not taken over meanwhile */
  if (__atomic_load_n(&e->serial, __ATOMIC_ACQUIRE) != serial)
    return;
  __typeof__(timeline_add) add = __atomic_load_n(&timeline_add, __ATOMIC_ACQUIRE);
  if (add != NULL)
    add(copy.enter_ns, leave_ns, copy.comm_index, copy.size, copy.seq,
        copy.count, copy.call, copy.op, copy.type);
}

/* The calls of XLA's still in MPI, as the hang reports name them: "XLA's
 * MPI_Allreduce #3 SUM float32[4] on 2 ranks", several joined by "; " (""
 * when none). Written into `out` (at most `capacity` bytes, NUL ended);
 * returns the length. Any thread, no lock, no Python, no allocation: the same
 * signature as the extensions' readers (_stacks's set_in_flight takes it). */
MPIABI_API size_t mpi4jax_dist_mpiabi_in_flight(char *out, size_t capacity) {
  if (capacity == 0)
    return 0;
  size_t used = 0;
  out[0] = '\0';
  const unsigned long long last =
      __atomic_load_n(&record_next, __ATOMIC_ACQUIRE);
  const unsigned long long first =
      last > RECORD_ENTRIES ? last - RECORD_ENTRIES + 1 : 1;
  for (unsigned long long s = first; s <= last && used + 1 < capacity; ++s) {
    const RecordEntry *e = &record_entries[(s - 1) % RECORD_ENTRIES];
    if (__atomic_load_n(&e->serial, __ATOMIC_ACQUIRE) != s ||
        __atomic_load_n(&e->state, __ATOMIC_ACQUIRE) != kEntered)
      continue;
    /* Each field read once: a call wrapping round may rewrite the entry now
     * (a torn line in a report at worst; the strings are all static). */
    const char *call = e->call, *op = e->op, *type = e->type;
    const long long calls = e->seq, elements = e->count;
    const int size = e->size, peer = e->peer;
    char seq[32] = "", count[32] = "", on[32] = "";
    if (calls)
      snprintf(seq, sizeof seq, " #%lld", calls);
    if (type && elements >= 0)
      snprintf(count, sizeof count, "[%lld]", elements);
    if (size)
      snprintf(on, sizeof on, " on %d ranks", size);
    else if (peer >= 0)
      snprintf(on, sizeof on, " with rank %d", peer);
    const int n = snprintf(out + used, capacity - used,
                           "%sXLA's %s%s%s%s%s%s%s%s", used ? "; " : "",
                           call ? call : "MPI", seq, op ? " " : "",
                           op ? op : "", type ? " " : "", type ? type : "",
                           count, on);
    if (n < 0)
      break;
    used += (size_t)n;
    if (used >= capacity)
      used = capacity - 1;
  }
  return used;
}

