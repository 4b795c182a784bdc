// The reduction ops and element types the handlers take, as MPI's: ops by the
// code mpi4jax_dist/ops/common.py gives them (OPS), types by XLA's.

#ifndef MPI4JAX_DIST_FFI_OP_DTYPE_H_
#define MPI4JAX_DIST_FFI_OP_DTYPE_H_

#include <cstdint>

#include "mpi_base.h"

namespace mpi4jax_dist {

// Reduction ops, numbered as mpi4jax_dist/ops/common.py numbers them (OPS).
MPI4JAX_DIST_CORE_API bool OpFromCode(int32_t code, MPI_Op* op);

// The MPI datatype of an XLA element type; false for the ones MPI cannot reduce
// (the Python side refuses those before any MPI call, this is the backstop).
MPI4JAX_DIST_CORE_API bool DatatypeOf(ffi::DataType dtype, MPI_Datatype* out);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_OP_DTYPE_H_
