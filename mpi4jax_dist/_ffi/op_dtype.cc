// The reduction ops and element types the handlers take, as MPI's
// (op_dtype.h).

#include "op_dtype.h"

#include <cstdint>

namespace mpi4jax_dist {

// Reduction ops, numbered as mpi4jax_dist/ops/common.py numbers them (OPS).
bool OpFromCode(int32_t code, MPI_Op* op) {
  static const MPI_Op kOps[] = {MPI_SUM, MPI_PROD, MPI_MIN,  MPI_MAX, MPI_LAND,
                                MPI_LOR, MPI_LXOR, MPI_BAND, MPI_BOR, MPI_BXOR};
  if (code < 0 || code >= static_cast<int32_t>(sizeof(kOps) / sizeof(kOps[0])))
    return false;
  *op = kOps[code];
  return true;
}

// The MPI datatype of an XLA element type; false for the ones MPI cannot reduce
// (the Python side refuses those before any MPI call, this is the backstop).
bool DatatypeOf(ffi::DataType dtype, MPI_Datatype* out) {
  switch (dtype) {
    case ffi::DataType::PRED:
      *out = MPI_C_BOOL;
      return true;
    case ffi::DataType::S8:
      *out = MPI_INT8_T;
      return true;
    case ffi::DataType::S16:
      *out = MPI_INT16_T;
      return true;
    case ffi::DataType::S32:
      *out = MPI_INT32_T;
      return true;
    case ffi::DataType::S64:
      *out = MPI_INT64_T;
      return true;
    case ffi::DataType::U8:
      *out = MPI_UINT8_T;
      return true;
    case ffi::DataType::U16:
      *out = MPI_UINT16_T;
      return true;
    case ffi::DataType::U32:
      *out = MPI_UINT32_T;
      return true;
    case ffi::DataType::U64:
      *out = MPI_UINT64_T;
      return true;
    case ffi::DataType::F32:
      *out = MPI_FLOAT;
      return true;
    case ffi::DataType::F64:
      *out = MPI_DOUBLE;
      return true;
    case ffi::DataType::C64:
      *out = MPI_C_FLOAT_COMPLEX;
      return true;
    case ffi::DataType::C128:
      *out = MPI_C_DOUBLE_COMPLEX;
      return true;
    default:
      return false;
  }
}

}  // namespace mpi4jax_dist
