// What every MPI call of the handlers needs (mpi_base.h): MPI's errors as XLA
// FFI errors, and the MPI the headers describe.

#include "mpi_base.h"

#include <string>

namespace mpi4jax_dist {

// "MPI_Allreduce failed: <MPI's own words>" for an MPI error code.
ffi::Error MpiError(const char* what, int code, const char* who) {
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
ffi::Error CheckMpiUsable(const char* who) {
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
std::string HeaderMpiLibrary() {
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
