/* The MPIABI wrapper's types (mpiabi.c): the ABI's, from MPItrampoline's public
 * mpiabi.h (version 2.9), checked against the native MPI's, and the translation
 * of a status between the two. Handles are uintptr_t, each the native handle
 * cast (MPICH's are ints, Open MPI's pointers); MPIABI_Status is a union big
 * enough for any native MPI_Status, then MPI_SOURCE, MPI_TAG and MPI_ERROR. */

#ifndef MPI4JAX_DIST_FFI_MPIABI_TYPES_H_
#define MPI4JAX_DIST_FFI_MPIABI_TYPES_H_

#include <mpi.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

#endif /* MPI4JAX_DIST_FFI_MPIABI_TYPES_H_ */
