// What every MPI call of the handlers needs: the MPI's own header, which
// large-count calls it has, and its errors as XLA FFI errors.

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

namespace mpi4jax_dist {

namespace ffi = xla::ffi;

// The function a message is about, by default the blocking allreduce.
constexpr const char* kAllreduceName = "mpi4jax_dist.allreduce";

// "MPI_Allreduce failed: <MPI's own words>" for an MPI error code.
inline ffi::Error MpiError(const char* what, int code,
                           const char* who = kAllreduceName) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    length = 0;
  }
  return ffi::Error::Internal(std::string(who) + ": " + what +
                              " failed with MPI error " + std::to_string(code) +
                              ": " + std::string(text, length));
}

// MPI must be up (and not yet finalized) before a handler may call it: a
// clear error instead of MPI's abort.
inline ffi::Error CheckMpiUsable(const char* who = kAllreduceName) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(who) + ": MPI is " +
            (finalized ? "already finalized" : "not initialized") +
            "; import mpi4py.MPI before the call and keep MPI up until the "
            "last one has run.");
  }
  return ffi::Error::Success();
}

// The version of MPI these headers describe, for the import-time check.
inline std::string HeaderMpiLibrary() {
#if defined(OMPI_MAJOR_VERSION)
  return "Open MPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
         std::to_string(OMPI_MINOR_VERSION) + "." +
         std::to_string(OMPI_RELEASE_VERSION);
#elif defined(I_MPI_VERSION)  // before MPICH: Intel's mpi.h defines both
  return std::string("Intel(R) MPI Library ") + I_MPI_VERSION;
#elif defined(MPICH_VERSION)
  return std::string("MPICH ") + MPICH_VERSION;
#else
  return "MPI " + std::to_string(MPI_VERSION) + "." +
         std::to_string(MPI_SUBVERSION);
#endif
}

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MPI_BASE_H_
