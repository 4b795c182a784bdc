// What the two Python modules (_cpu, _cuda) define alike, bound with nanobind
// (module_common.cc, compiled into each): the MPI they call, the core's
// communicator registry, collective timeout, record and counts, and handlers
// handed to jax.ffi.register_ffi_target as capsules.

#ifndef MPI4JAX_DIST_FFI_MODULE_COMMON_H_
#define MPI4JAX_DIST_FFI_MODULE_COMMON_H_

#include <nanobind/nanobind.h>

#include <type_traits>
#include <vector>

#include "stats.h"
#include "xla/ffi/api/c_api.h"

namespace mpi4jax_dist {

namespace nb = nanobind;

// An XLA FFI handler as the capsule jax.ffi.register_ffi_target takes.
template <typename T>
nb::capsule EncapsulateFfiHandler(T* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler (XLA_FFI_DEFINE_HANDLER_SYMBOL)");
  return nb::capsule(reinterpret_cast<void*>(handler));
}

// A dict of counts, for a module's stats().
nb::dict StatsDict(const std::vector<StatsItems>& groups);

// What both modules define: the MPI they call (library_version, HEADER_MPI,
// MPI_STANDARD, LARGE_COUNT, ALLREDUCE_LARGE_COUNT), the communicator registry
// (register_comm, call_counts) and the collective timeout
// (set_collective_timeout, alarm).
void DefineCommon(nb::module_& m);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_MODULE_COMMON_H_
