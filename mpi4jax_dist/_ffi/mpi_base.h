// What every MPI call of the handlers needs: the MPI's own header, which
// large-count calls it has, and its errors as XLA FFI errors; and what the
// core exports.
//
// The core (the communicator registry, the record of calls, the agreement of
// the ranks, the collective timeout, the counts, the MPI lock, and the
// allreduces over host memory) is one shared library, _core, that both Python
// modules (_cpu, _cuda) link: a process has one of each, whichever modules it
// loads (conf/builder.py says why a library of its own). What it exports is
// marked MPI4JAX_DIST_CORE_API; it is built with -fvisibility=hidden like the
// modules.

#ifndef MPI4JAX_DIST_FFI_MPI_BASE_H_
#define MPI4JAX_DIST_FFI_MPI_BASE_H_

#include <mpi.h>

#include <string>

#include "xla/ffi/api/ffi.h"

// MPI-4 brought the large-count ("_c") functions: MPICH >= 4 has them, Open MPI
// 5.0 (whose headers say MPI 3.1) does not. Without them a call takes at most
// INT_MAX elements, and larger messages go in chunks.
#if defined(MPI_VERSION) && MPI_VERSION >= 4
#define MPI4JAX_DIST_LARGE_COUNT 1
#else
#define MPI4JAX_DIST_LARGE_COUNT 0
#endif

// Intel MPI 2021.18.1's MPI_Allreduce_c returns MPI_SUCCESS without reducing a
// count above INT_MAX (seen with mpi4py alone: 2**31 + 16 int8, in place or
// not; its MPI_Iallreduce_c is right): the blocking allreduce goes in chunks of
// at most INT_MAX elements there.
#if MPI4JAX_DIST_LARGE_COUNT && !defined(I_MPI_VERSION)
#define MPI4JAX_DIST_ALLREDUCE_C 1
#else
#define MPI4JAX_DIST_ALLREDUCE_C 0
#endif

// What the core library exports (conf/builder.py builds it with
// -DMPI4JAX_DIST_BUILDING_CORE); nothing for the modules that link it.
#if defined(MPI4JAX_DIST_BUILDING_CORE)
#define MPI4JAX_DIST_CORE_API __attribute__((visibility("default")))
#else
#define MPI4JAX_DIST_CORE_API
#endif

namespace mpi4jax_dist {

namespace ffi = xla::ffi;

// The function a message is about, by default the blocking allreduce.
constexpr const char* kAllreduceName = "mpi4jax_dist.allreduce";

// "MPI_Allreduce failed: <MPI's own words>" for an MPI error code.
MPI4JAX_DIST_CORE_API ffi::Error MpiError(const char* what, int code,
                                          const char* who = kAllreduceName);

// MPI must be up (and not yet finalized) before a handler may call it: a
// clear error instead of MPI's abort.
MPI4JAX_DIST_CORE_API ffi::Error CheckMpiUsable(
    const char* who = kAllreduceName);

// The version of MPI these headers describe, for the import-time check.
MPI4JAX_DIST_CORE_API std::string HeaderMpiLibrary();

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MPI_BASE_H_
