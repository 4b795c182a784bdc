/* The MPIABI wrapper's declarations (mpiabi.c and the sources beside it, built
 * into _mpiabi by conf/builder.py): the ABI's types, from MPItrampoline's public
 * mpiabi.h (version 2.9), checked against the native MPI's, and the functions the
 * wrapper's sources share, which the library does not export (it is built with
 * -fvisibility=hidden; MPIABI_API marks what it exports).
 *
 * Handles are uintptr_t, each the native handle cast (MPICH's are ints, Open
 * MPI's pointers); MPIABI_Status is a union big enough for any native
 * MPI_Status, then MPI_SOURCE, MPI_TAG and MPI_ERROR.
 *
 * The sources: mpiabi.c (the functions written by hand, everything XLA calls),
 * mpiabi_record.c (the record of XLA's calls), mpiabi_world.c (the world XLA
 * sees), and mpiabi_generated.c, which conf/mpiabi_gen.py writes into the build
 * directory (the constants and the stubs). */

#ifndef MPI4JAX_DIST_FFI_MPIABI_H_
#define MPI4JAX_DIST_FFI_MPIABI_H_

#include <mpi.h>

#include <stddef.h>
#include <stdint.h>

/* What the library exports: the ABI's names and mpi4jax_dist's own functions. */
#define MPIABI_API __attribute__((visibility("default")))

typedef intptr_t MPIABI_Aint;
typedef int64_t MPIABI_Count;
typedef int MPIABI_Fint;
typedef int64_t MPIABI_Offset;

typedef uintptr_t MPIABI_Comm;
typedef uintptr_t MPIABI_Datatype;
typedef uintptr_t MPIABI_Errhandler;
typedef uintptr_t MPIABI_File;
typedef uintptr_t MPIABI_Group;
typedef uintptr_t MPIABI_Info;
typedef uintptr_t MPIABI_Message;
typedef uintptr_t MPIABI_Op;
typedef uintptr_t MPIABI_Request;
typedef uintptr_t MPIABI_Win;

/* The native status first (Open MPI's is 4 ints and a size_t, MPICH's and Intel
 * MPI's 5 ints), then the public fields: 10 Fortran integers in all on LP64. */
typedef struct {
  union {
    struct {
      int f0, f1, f2, f3;
      size_t f4;
    } openmpi;
    struct {
      int f0, f1, f2, f3, f4;
    } mpich;
  } mpi_status;
  int MPI_SOURCE;
  int MPI_TAG;
  int MPI_ERROR;
} MPIABI_Status;

/* Callbacks: the ABI leaves their arguments unspecified. */
typedef void MPIABI_Comm_copy_attr_function(void);
typedef void MPIABI_Comm_delete_attr_function(void);
typedef void MPIABI_Copy_function(void);
typedef void MPIABI_Delete_function(void);
typedef void MPIABI_Type_copy_attr_function(void);
typedef void MPIABI_Type_delete_attr_function(void);
typedef void MPIABI_Win_copy_attr_function(void);
typedef void MPIABI_Win_delete_attr_function(void);
typedef int MPIABI_Datarep_conversion_function(void *userbuf,
                                               MPIABI_Datatype datatype,
                                               int count, void *filebuf,
                                               MPIABI_Offset position,
                                               void *extra_state);

_Static_assert(sizeof(MPIABI_Status) == 10 * sizeof(MPIABI_Fint),
               "MPIABI_Status is 10 Fortran integers on LP64");
_Static_assert(sizeof(MPI_Status) <= sizeof(((MPIABI_Status *)0)->mpi_status),
               "the native MPI_Status must fit in MPIABI_Status's union");
_Static_assert(sizeof(MPI_Comm) <= sizeof(uintptr_t) &&
                   sizeof(MPI_Datatype) <= sizeof(uintptr_t) &&
                   sizeof(MPI_Op) <= sizeof(uintptr_t) &&
                   sizeof(MPI_Request) <= sizeof(uintptr_t),
               "native handles must fit in uintptr_t");
/* The ABI's buffer sizes, which callers allocate, must hold the native strings. */
_Static_assert(MPI_MAX_ERROR_STRING <= 1024, "MPIABI_MAX_ERROR_STRING");
_Static_assert(MPI_MAX_LIBRARY_VERSION_STRING <= 8192,
               "MPIABI_MAX_LIBRARY_VERSION_STRING");
_Static_assert(MPI_MAX_PROCESSOR_NAME <= 256, "MPIABI_MAX_PROCESSOR_NAME");

/* ---- Shared by the wrapper's sources, not exported ---- */

/* mpiabi_generated.c: give every constant MPIABI_<NAME> its native value (run
 * when the library loads, mpiabi.c), and the names of the functions XLA calls,
 * for the stubs' message. */
void mpiabi_set_constants(void);
extern const char mpiabi_xla_calls[];

/* mpiabi.c: what a stub of mpiabi_generated.c calls: say so, and abort. */
_Noreturn void mpiabi_not_implemented(const char *name);

/* mpiabi_world.c: the native communicator for an ABI handle XLA passes in (XLA's
 * world is its duplicate, once handed over). */
MPI_Comm comm_in(uintptr_t comm);

/* mpiabi_record.c: the record of XLA's calls that can wait on other ranks. A
 * collective passes its communicator, numbered there; a point-to-point call
 * MPI_COMM_NULL and its peer, MPI_Wait neither. record_enter returns the call's
 * serial, for record_return; record_forget drops a communicator about to be
 * freed. type_name and op_name name a native datatype and op as the reports do
 * ("float32", "SUM"). */
unsigned long long record_enter(const char *call, MPI_Comm comm, int peer,
                                const char *op, const char *type,
                                long long count);
void record_return(unsigned long long serial);
void record_forget(MPI_Comm comm);
const char *type_name(MPI_Datatype type);
const char *op_name(MPI_Op op);

#endif /* MPI4JAX_DIST_FFI_MPIABI_H_ */
