/* mpi4jax_dist's MPIABI wrapper: the library jaxlib's MPItrampoline loads.
 *
 * jaxlib (0.6.0 to 0.10.2 at least) carries XLA's MPI collectives for CPU
 * (jax_cpu_collectives_implementation="mpi"). They call MPI through MPItrampoline
 * 5.3.1, linked into jaxlib: when jaxlib loads, MPItrampoline dlopens the library
 * named by MPITRAMPOLINE_LIB and resolves every name of its ABI ("MPIABI" 2.9) in it
 * with dlsym. This is that library, built by conf/builder.py into _mpiabi against
 * the MPI mpi4py loads.
 *
 * The ABI's types are MPItrampoline's (mpiabi.h): constants are variables
 * MPIABI_<NAME> that MPItrampoline reads once. Here each constant holds the
 * native value cast to its ABI type, so a handle translates by a cast both ways,
 * and the sentinels (MPI_STATUS_IGNORE, MPI_IN_PLACE, MPI_BOTTOM, ...) are the
 * native pointers, passed through as they are.
 *
 * This file holds the functions implemented by hand: everything XLA calls (the
 * functions tagged "xla" in mpiabi_names.txt; the build fails without one) and a few
 * more that are cheap and useful. conf/mpiabi_gen.py writes the rest into
 * mpiabi_generated.c, compiled beside it: the constants and a stub for every
 * other function, which says it is not implemented and aborts. A function here
 * is exported when its definition starts a line with "MPIABI_API <type>
 * MPIABI_<Name>(": that is how the generator knows it needs no stub. The calls that can wait on other ranks
 * are written into the record of XLA's calls (mpiabi_record.c), which the hang
 * reports quote.
 *
 * Where XLA's use of MPI clashes with a process where mpi4py owns MPI (the reason
 * this is not a plain translation layer):
 * - MPI_Init_thread when MPI is already initialized (mpi4py did it) succeeds and
 *   reports the thread level MPI provides; the wrapper remembers whether it was the
 *   one that initialized MPI.
 * - MPI_Finalize finalizes only what the wrapper initialized, and only once: XLA's
 *   exit handler calls it before XLA frees its cached communicators, and mpi4py
 *   finalizes what it initialized at exit.
 * - MPI_Comm_free after MPI is finalized succeeds quietly (MPICH would exit 1 and
 *   Open MPI 14 at the end of every job).
 * - MPI_Is_thread_main says yes on every thread when MPI provides
 *   MPI_THREAD_MULTIPLE (see there).
 * - MPI_COMM_WORLD, wherever XLA passes it, is a private duplicate of the world
 *   once mpi4jax_dist has handed one over (mpiabi_world.c).
 */

#define _GNU_SOURCE /* dladdr */

#include <mpi.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mpiabi.h"

/* Handles: the ABI value is the native one cast to uintptr_t; XLA's world is
 * its duplicate (comm_in). */
#define COMM(h) comm_in(h)
#define TYPE(h) ((MPI_Datatype)(h))
#define OP(h) ((MPI_Op)(h))
#define REQUEST(h) ((MPI_Request)(h))
#define ABI(h) ((uintptr_t)(h))

/* Return the native status to hand MPI for the ABI status `abi`: MPI_STATUS_IGNORE
 * as it is, else `native`, filled from `abi` so that the fields MPI leaves alone
 * (MPI_ERROR, in single-completion calls) keep their values. */
static MPI_Status *status_in(const MPIABI_Status *abi, MPI_Status *native) {
  if (abi == (const MPIABI_Status *)MPI_STATUS_IGNORE)
    return MPI_STATUS_IGNORE;
  memcpy(native, &abi->mpi_status, sizeof *native);
  native->MPI_SOURCE = abi->MPI_SOURCE;
  native->MPI_TAG = abi->MPI_TAG;
  native->MPI_ERROR = abi->MPI_ERROR;
  return native;
}

/* Copy a native status back into the ABI status (nothing for an ignored one). */
static void status_out(const MPI_Status *native, MPIABI_Status *abi) {
  if (native == MPI_STATUS_IGNORE)
    return;
  memcpy(&abi->mpi_status, native, sizeof *native);
  abi->MPI_SOURCE = native->MPI_SOURCE;
  abi->MPI_TAG = native->MPI_TAG;
  abi->MPI_ERROR = native->MPI_ERROR;
}

/* ---- What MPItrampoline checks first ---- */

/* The ABI version this library provides: MPItrampoline wants major 2, minor >= 9. */
MPIABI_API const int mpiabi_version_major = 2;
MPIABI_API const int mpiabi_version_minor = 9;
MPIABI_API const int mpiabi_version_patch = 0;

/* This wrapper's own version (MPItrampoline only prints it, when verbose). */
MPIABI_API const int mpiwrapper_version_major = 0;
MPIABI_API const int mpiwrapper_version_minor = 1;
MPIABI_API const int mpiwrapper_version_patch = 0;

/* MPItrampoline calls this once; jaxlib's has no Fortran interface to feed. */
MPIABI_API void mpiwrapper_export_fortran_constants_(void) {}

/* ---- Initialization and the environment ---- */

/* Whether this wrapper initialized MPI (and so finalizes it); else someone else
 * (mpi4py) did, and finalizes it. */
static int wrapper_initialized = 0;

/* XLA initializes with MPI_THREAD_FUNNELED and then calls MPI from its own worker
 * threads; where the wrapper is the one to initialize MPI, it asks for
 * MPI_THREAD_MULTIPLE, which is what mpi4py asks for by default too. */
static int init(int *argc, char ***argv, int required, int *provided) {
  int flag = 0;
  int rc = MPI_Initialized(&flag);
  if (rc != MPI_SUCCESS)
    return rc;
  if (flag) /* mpi4py (or anyone) did it already: report what MPI provides */
    return provided ? MPI_Query_thread(provided) : MPI_SUCCESS;
  int level = 0;
  if (required < MPI_THREAD_MULTIPLE)
    required = MPI_THREAD_MULTIPLE;
  rc = MPI_Init_thread(argc, argv, required, &level);
  if (rc == MPI_SUCCESS)
    wrapper_initialized = 1;
  if (provided)
    *provided = level;
  return rc;
}

MPIABI_API int MPIABI_Init_thread(int *argc, char ***argv, int required,
                                  int *provided) {
  return init(argc, argv, required, provided);
}

MPIABI_API int MPIABI_Init(int *argc, char ***argv) {
  return init(argc, argv, MPI_THREAD_SINGLE, NULL);
}

MPIABI_API int MPIABI_Initialized(int *flag) { return MPI_Initialized(flag); }

MPIABI_API int MPIABI_Finalized(int *flag) { return MPI_Finalized(flag); }

/* Finalize only if the wrapper initialized MPI and it is not finalized yet.
 * XLA's exit handler calls this while XLA still holds communicators (freed later,
 * see MPIABI_Comm_free); where mpi4py initialized MPI, mpi4py finalizes it at
 * exit. */
MPIABI_API int MPIABI_Finalize(void) {
  int finalized = 0;
  int rc = MPI_Finalized(&finalized);
  if (rc != MPI_SUCCESS)
    return rc;
  if (!wrapper_initialized || finalized)
    return MPI_SUCCESS;
  return MPI_Finalize();
}

MPIABI_API int MPIABI_Query_thread(int *provided) {
  return MPI_Query_thread(provided);
}

/* XLA refuses to create communicators ("MPI: Communicator requested from a thread
 * that is not the one MPI was initialized from", in jaxlib 0.10.2) unless
 * MPI_Is_thread_main says yes, and it creates them lazily, on whichever thread
 * first runs a collective: a Python thread, or one of XLA's. The check protects
 * MPI_THREAD_FUNNELED and MPI_THREAD_SERIALIZED programs, where only the main
 * thread may call MPI. Under MPI_THREAD_MULTIPLE (mpi4py's default, and what this
 * wrapper asks for when it initializes MPI) every thread may call MPI, so every
 * thread counts as the main one here; below that, the real answer. */
MPIABI_API int MPIABI_Is_thread_main(int *flag) {
  int provided = MPI_THREAD_SINGLE;
  int rc = MPI_Query_thread(&provided);
  if (rc != MPI_SUCCESS)
    return rc;
  if (provided == MPI_THREAD_MULTIPLE) {
    *flag = 1;
    return MPI_SUCCESS;
  }
  return MPI_Is_thread_main(flag);
}

MPIABI_API int MPIABI_Get_version(int *version, int *subversion) {
  return MPI_Get_version(version, subversion);
}

MPIABI_API int MPIABI_Get_library_version(char *version, int *resultlen) {
  return MPI_Get_library_version(version, resultlen);
}

MPIABI_API int MPIABI_Get_processor_name(char *name, int *resultlen) {
  return MPI_Get_processor_name(name, resultlen);
}

MPIABI_API int MPIABI_Abort(MPIABI_Comm comm, int errorcode) {
  return MPI_Abort(COMM(comm), errorcode);
}

MPIABI_API int MPIABI_Error_class(int errorcode, int *errorclass) {
  return MPI_Error_class(errorcode, errorclass);
}

MPIABI_API int MPIABI_Error_string(int errorcode, char *string,
                                   int *resultlen) {
  return MPI_Error_string(errorcode, string, resultlen);
}

MPIABI_API double MPIABI_Wtime(void) { return MPI_Wtime(); }

MPIABI_API double MPIABI_Wtick(void) { return MPI_Wtick(); }

/* ---- Communicators ---- */

MPIABI_API int MPIABI_Comm_rank(MPIABI_Comm comm, int *rank) {
  return MPI_Comm_rank(COMM(comm), rank);
}

MPIABI_API int MPIABI_Comm_size(MPIABI_Comm comm, int *size) {
  return MPI_Comm_size(COMM(comm), size);
}

MPIABI_API int MPIABI_Comm_compare(MPIABI_Comm comm1, MPIABI_Comm comm2,
                                   int *result) {
  return MPI_Comm_compare(COMM(comm1), COMM(comm2), result);
}

MPIABI_API int MPIABI_Comm_split(MPIABI_Comm comm, int color, int key,
                                 MPIABI_Comm *newcomm) {
  MPI_Comm native = MPI_COMM_NULL;
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Comm_split", c, -1, NULL, NULL, -1);
  int rc = MPI_Comm_split(c, color, key, &native);
  record_return(r);
  *newcomm = ABI(native);
  return rc;
}

MPIABI_API int MPIABI_Comm_dup(MPIABI_Comm comm, MPIABI_Comm *newcomm) {
  MPI_Comm native = MPI_COMM_NULL;
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Comm_dup", c, -1, NULL, NULL, -1);
  int rc = MPI_Comm_dup(c, &native);
  record_return(r);
  *newcomm = ABI(native);
  return rc;
}

/* XLA frees its cached communicators after its exit handler has called
 * MPI_Finalize, and mpi4py may have finalized MPI before either: once MPI is
 * finalized there is nothing left to free, so succeed quietly. */
MPIABI_API int MPIABI_Comm_free(MPIABI_Comm *comm) {
  int finalized = 0;
  if (MPI_Finalized(&finalized) == MPI_SUCCESS && finalized) {
    *comm = ABI(MPI_COMM_NULL);
    return MPI_SUCCESS;
  }
  MPI_Comm native = (MPI_Comm)*comm; /* never XLA's world: not XLA's to free */
  record_forget(native);
  int rc = MPI_Comm_free(&native);
  *comm = ABI(native);
  return rc;
}

/* ---- Datatypes ---- */

MPIABI_API int MPIABI_Type_size(MPIABI_Datatype datatype, int *size) {
  return MPI_Type_size(TYPE(datatype), size);
}

MPIABI_API int MPIABI_Get_count(const MPIABI_Status *status,
                                MPIABI_Datatype datatype, int *count) {
  MPI_Status native;
  return MPI_Get_count(status_in(status, &native),
                       TYPE(datatype), count);
}

/* ---- Point to point ---- */

MPIABI_API int MPIABI_Send(const void *buf, int count, MPIABI_Datatype datatype,
                           int dest, int tag, MPIABI_Comm comm) {
  const unsigned long long r = record_enter(
      "MPI_Send", MPI_COMM_NULL, dest, NULL, type_name(TYPE(datatype)), count);
  int rc = MPI_Send(buf, count, TYPE(datatype), dest, tag, COMM(comm));
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Recv(void *buf, int count, MPIABI_Datatype datatype,
                           int source, int tag, MPIABI_Comm comm,
                           MPIABI_Status *status) {
  MPI_Status native;
  MPI_Status *s = status_in(status, &native);
  const unsigned long long r = record_enter(
      "MPI_Recv", MPI_COMM_NULL, source, NULL, type_name(TYPE(datatype)), count);
  int rc = MPI_Recv(buf, count, TYPE(datatype), source, tag, COMM(comm), s);
  record_return(r);
  status_out(s, status);
  return rc;
}

MPIABI_API int MPIABI_Isend(const void *buf, int count,
                            MPIABI_Datatype datatype, int dest, int tag,
                            MPIABI_Comm comm, MPIABI_Request *request) {
  MPI_Request native = MPI_REQUEST_NULL;
  int rc =
      MPI_Isend(buf, count, TYPE(datatype), dest, tag, COMM(comm), &native);
  *request = ABI(native);
  return rc;
}

MPIABI_API int MPIABI_Irecv(void *buf, int count, MPIABI_Datatype datatype,
                            int source, int tag, MPIABI_Comm comm,
                            MPIABI_Request *request) {
  MPI_Request native = MPI_REQUEST_NULL;
  int rc =
      MPI_Irecv(buf, count, TYPE(datatype), source, tag, COMM(comm), &native);
  *request = ABI(native);
  return rc;
}

MPIABI_API int MPIABI_Wait(MPIABI_Request *request, MPIABI_Status *status) {
  MPI_Request native = REQUEST(*request);
  MPI_Status native_status;
  MPI_Status *s = status_in(status, &native_status);
  const unsigned long long r =
      record_enter("MPI_Wait", MPI_COMM_NULL, -1, NULL, NULL, -1);
  int rc = MPI_Wait(&native, s);
  record_return(r);
  *request = ABI(native);
  status_out(s, status);
  return rc;
}

/* Requests are 4 bytes in MPICH and 8 in the ABI, and statuses differ too: copy
 * both arrays (on the stack up to this many). */
#define WAITALL_STACK 16

MPIABI_API int MPIABI_Waitall(int count, MPIABI_Request *array_of_requests,
                              MPIABI_Status *array_of_statuses) {
  const int n = count > 0 ? count : 0;
  const int ignore =
      array_of_statuses == (MPIABI_Status *)MPI_STATUSES_IGNORE;
  MPI_Request request_stack[WAITALL_STACK];
  MPI_Status status_stack[WAITALL_STACK];
  MPI_Request *requests = request_stack;
  MPI_Status *statuses = ignore ? MPI_STATUSES_IGNORE : status_stack;
  if (n > WAITALL_STACK) {
    requests = malloc(n * sizeof *requests);
    if (!ignore)
      statuses = malloc(n * sizeof *statuses);
    /* Open MPI's MPI_STATUSES_IGNORE is a null pointer: not a failed malloc. */
    if (!requests || (!ignore && !statuses)) {
      free(requests);
      if (!ignore)
        free(statuses);
      return MPI_ERR_NO_MEM;
    }
  }
  for (int i = 0; i < n; ++i) {
    requests[i] = REQUEST(array_of_requests[i]);
    if (!ignore)
      status_in(&array_of_statuses[i], &statuses[i]);
  }
  const unsigned long long r =
      record_enter("MPI_Waitall", MPI_COMM_NULL, -1, NULL, NULL, -1);
  int rc = MPI_Waitall(count, requests, statuses);
  record_return(r);
  for (int i = 0; i < n; ++i) {
    array_of_requests[i] = ABI(requests[i]);
    if (!ignore)
      status_out(&statuses[i], &array_of_statuses[i]);
  }
  if (n > WAITALL_STACK) {
    free(requests);
    if (!ignore)
      free(statuses);
  }
  return rc;
}

MPIABI_API int MPIABI_Sendrecv(const void *sendbuf, int sendcount,
                               MPIABI_Datatype sendtype, int dest, int sendtag,
                               void *recvbuf, int recvcount,
                               MPIABI_Datatype recvtype, int source,
                               int recvtag, MPIABI_Comm comm,
                               MPIABI_Status *status) {
  MPI_Status native;
  MPI_Status *s = status_in(status, &native);
  const unsigned long long r =
      record_enter("MPI_Sendrecv", MPI_COMM_NULL, dest, NULL,
                   type_name(TYPE(sendtype)), sendcount);
  int rc = MPI_Sendrecv(sendbuf, sendcount, TYPE(sendtype), dest, sendtag,
                        recvbuf, recvcount, TYPE(recvtype), source, recvtag,
                        COMM(comm), s);
  record_return(r);
  status_out(s, status);
  return rc;
}

/* ---- Collectives ---- */

MPIABI_API int MPIABI_Barrier(MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Barrier", c, -1, NULL, NULL, -1);
  int rc = MPI_Barrier(c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Bcast(void *buffer, int count, MPIABI_Datatype datatype,
                            int root, MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Bcast", c, -1, NULL, type_name(TYPE(datatype)), count);
  int rc = MPI_Bcast(buffer, count, TYPE(datatype), root, c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Allreduce(const void *sendbuf, void *recvbuf, int count,
                                MPIABI_Datatype datatype, MPIABI_Op op,
                                MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Allreduce", c, -1, op_name(OP(op)), type_name(TYPE(datatype)), count);
  int rc = MPI_Allreduce(sendbuf, recvbuf, count, TYPE(datatype), OP(op), c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Reduce(const void *sendbuf, void *recvbuf, int count,
                             MPIABI_Datatype datatype, MPIABI_Op op, int root,
                             MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Reduce", c, -1, op_name(OP(op)), type_name(TYPE(datatype)), count);
  int rc =
      MPI_Reduce(sendbuf, recvbuf, count, TYPE(datatype), OP(op), root, c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Allgather(const void *sendbuf, int sendcount,
                                MPIABI_Datatype sendtype, void *recvbuf,
                                int recvcount, MPIABI_Datatype recvtype,
                                MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Allgather", c, -1, NULL, type_name(TYPE(sendtype)), sendcount);
  int rc = MPI_Allgather(sendbuf, sendcount, TYPE(sendtype), recvbuf,
                         recvcount, TYPE(recvtype), c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Alltoall(const void *sendbuf, int sendcount,
                               MPIABI_Datatype sendtype, void *recvbuf,
                               int recvcount, MPIABI_Datatype recvtype,
                               MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Alltoall", c, -1, NULL, type_name(TYPE(sendtype)), sendcount);
  int rc = MPI_Alltoall(sendbuf, sendcount, TYPE(sendtype), recvbuf,
                        recvcount, TYPE(recvtype), c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Reduce_scatter(const void *sendbuf, void *recvbuf,
                                     const int *recvcounts,
                                     MPIABI_Datatype datatype, MPIABI_Op op,
                                     MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Reduce_scatter", c, -1, op_name(OP(op)), type_name(TYPE(datatype)), -1);
  int rc = MPI_Reduce_scatter(sendbuf, recvbuf, recvcounts, TYPE(datatype),
                              OP(op), c);
  record_return(r);
  return rc;
}

MPIABI_API int MPIABI_Reduce_scatter_block(const void *sendbuf, void *recvbuf,
                                           int recvcount,
                                           MPIABI_Datatype datatype,
                                           MPIABI_Op op, MPIABI_Comm comm) {
  const MPI_Comm c = COMM(comm);
  const unsigned long long r = record_enter(
      "MPI_Reduce_scatter_block", c, -1, op_name(OP(op)), type_name(TYPE(datatype)), recvcount);
  int rc = MPI_Reduce_scatter_block(sendbuf, recvbuf, recvcount,
                                    TYPE(datatype), OP(op), c);
  record_return(r);
  return rc;
}

/* ---- MPIX extensions ---- */

/* Whether the native MPI can take device memory: its own MPIX_Query_<x>_support
 * where the MPI library has one (MPICH and Intel MPI do, Open MPI's CUDA and ROCm
 * builds too, not all in mpi.h), else 0. Looked up in the MPI library this
 * wrapper links to, found from one of its functions. 0 outside MPI_Init ...
 * MPI_Finalize too, where MPICH's query exits the process. */
static int query_support(const char *name) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    return 0;
  Dl_info info;
  if (!dladdr((void *)MPI_Init, &info) || !info.dli_fname)
    return 0;
  void *mpi = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!mpi)
    return 0;
  int (*query)(void) = (int (*)(void))dlsym(mpi, name);
  int answer = query ? query() : 0;
  dlclose(mpi);
  return answer;
}

MPIABI_API int MPIXABI_Query_cuda_support(void) {
  return query_support("MPIX_Query_cuda_support");
}

MPIABI_API int MPIXABI_Query_hip_support(void) {
  return query_support("MPIX_Query_hip_support");
}

MPIABI_API int MPIXABI_Query_ze_support(void) {
  return query_support("MPIX_Query_ze_support");
}

/* ---- The constants and the stubs (mpiabi_generated.c, conf/mpiabi_gen.py) ---- */

/* Runs when the library is loaded, before dlopen returns to MPItrampoline, which
 * then reads the constants. Set at run time, not by initializers: some native
 * values are addresses in the MPI library (Open MPI's handles, MPICH's
 * MPI_UNWEIGHTED), which C does not let a static initializer cast to uintptr_t. */
__attribute__((constructor)) static void mpiabi_load(void) {
  mpiabi_set_constants();
}

_Noreturn void mpiabi_not_implemented(const char *name) {
  fprintf(stderr,
          "mpi4jax_dist MPIABI wrapper: %s is not implemented (XLA calls only "
          "%s; the wrapper implements those and a few more)\n",
          name, mpiabi_xla_calls);
  fflush(stderr);
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized)
    MPI_Abort(MPI_COMM_WORLD, 1);
  abort();
}
