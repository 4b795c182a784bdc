// The CUDA handler of mpi4jax_dist.allreduce, and the Python module _cuda that
// hands it to JAX (jax.ffi.register_ffi_target(..., platform="CUDA")).
//
// conf/builder.py builds it where CUDA headers exist, beside _cpu, so that _cpu
// never depends on CUDA. The reduction itself (ReduceDeviceBuffer) is in
// cuda_staging.h: by a CUDA-aware MPI in place, or staged through pinned host
// memory, chosen per compiled call by the `cuda_aware` attribute
// (MPI4JAX_DIST_CUDA_AWARE_MPI, mpi4jax_dist/_config/ops.py).

#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "allreduce.h"
#include "cuda_staging.h"
#include "module_common.h"
#include "stats.h"
#include "xla/ffi/api/ffi.h"

#if defined(OPEN_MPI) && OPEN_MPI
#include <mpi-ext.h>  // MPIX_Query_cuda_support, where Open MPI has it
#endif

namespace ffi = xla::ffi;

namespace mpi4jax_dist {
namespace {

// x and a token in, the reduced x out (aliased with x by the lowering), as on
// the CPU; the token orders the call after every earlier MPI call. The header
// the ranks compare (agreement.h) goes apart from the device buffer, posted
// before it and judged before the call returns.
ffi::Error AllreduceCudaImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Token,
                             ffi::Result<ffi::AnyBuffer> y, int64_t comm_id,
                             int32_t op_code, int64_t chunk_bytes,
                             int32_t cuda_aware, int32_t check, int64_t site) {
  CountHandlerCall(x.untyped_data(), y->untyped_data());
  Call call;
  bool ready = false;
  if (ffi::Error error =
          BeginCall(x, *y, comm_id, op_code, chunk_bytes, kBlocking, site,
                    /*block=*/true, &call, &ready);
      error.failure()) {
    return error;
  }
  Turn turn(call.entry);
  if (turn.crossed()) {
    call.Finish(kFailed);
    return Crossed(call.who, call.entry->name, call.header.seq);
  }
  HeaderCheck header;
  if (ffi::Error error = header.Post(call.header, call.comm, check != 0);
      error.failure()) {
    call.Finish(kFailed);
    return error;
  }
  const size_t count = x.element_count();
  int rc = MPI_SUCCESS;
  // Under Open MPI no payload goes before the ranks agree (OneSizeFirst).
  if (OneSizeFirst() && !header.Agreed(&rc)) return call.Disagreed(rc);
  ffi::Error error = ffi::Error::Success();
  if (count > 0) {
    error = ReduceDeviceBuffer(
        stream, static_cast<const char*>(x.untyped_data()),
        static_cast<char*>(y->untyped_data()), count, x.size_bytes() / count,
        call.dtype, call.op, call.comm, chunk_bytes, cuda_aware != 0);
  }
  if (!header.Agreed(&rc)) return call.Disagreed(rc);
  call.Finish(error.success() ? kDone : kFailed);
  return error;
}

}  // namespace
}  // namespace mpi4jax_dist

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistAllreduceCuda,
                              mpi4jax_dist::AllreduceCudaImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("chunk_bytes")
                                  .Attr<int32_t>("cuda_aware")
                                  .Attr<int32_t>("check")
                                  .Attr<int64_t>("site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Mpi4jaxDistTokenAfterCuda, mpi4jax_dist::TokenAfterImpl,
    xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::Token>());

// ---------------------------------------------------------------------------
// The Python module: the handlers as capsules, what the MPI and CUDA are, and
// the pinned staging buffers.

namespace {

namespace nb = nanobind;

// Whether the MPI library says it can read device memory: True, False, or None
// where it has no way to say, and while MPI is not initialized or already
// finalized: MPICH's query ends the process then ("Attempting to use an MPI
// routine ... before initializing"), as mpiabi.c's query_support knows.
nb::object MpiCudaSupport() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return nb::none();
#if defined(OPEN_MPI) && OPEN_MPI && defined(OMPI_HAVE_MPI_EXT_CUDA) && \
    OMPI_HAVE_MPI_EXT_CUDA
  return nb::bool_(MPIX_Query_cuda_support() != 0);
#elif defined(MPICH_NUMVERSION) && MPICH_NUMVERSION >= 40100000
  return nb::bool_(MPIX_Query_cuda_support() != 0);
#else
  return nb::none();
#endif
}

// Sets the size of the pinned staging buffers (load_cuda: from
// MPI4JAX_DIST_STAGING_BYTES); refused while buffers of another size exist.
void SetStagingBytes(uint64_t bytes) {
  if (bytes < mpi4jax_dist::kMinStagingBytes ||
      bytes > static_cast<uint64_t>(SIZE_MAX)) {
    throw std::invalid_argument("set_staging_bytes(" + std::to_string(bytes) +
                                "): the staging buffer needs at least " +
                                std::to_string(mpi4jax_dist::kMinStagingBytes) +
                                " bytes (two elements of the largest type)");
  }
  if (!mpi4jax_dist::Pool().SetBytes(static_cast<size_t>(bytes))) {
    throw std::runtime_error(
        "set_staging_bytes(" + std::to_string(bytes) +
        "): pinned staging buffers of " +
        std::to_string(mpi4jax_dist::Pool().bytes()) +
        " bytes exist already; call release_pinned() first, while no "
        "allreduce runs");
  }
}

}  // namespace

NB_MODULE(_cuda, m) {
  using mpi4jax_dist::EncapsulateFfiHandler;
  m.doc() = "mpi4jax_dist's XLA FFI handlers for CUDA, built against one MPI.";
  mpi4jax_dist::DefineCommon(m);
  m.def(
      "allreduce_handler",
      [] { return EncapsulateFfiHandler(Mpi4jaxDistAllreduceCuda); },
      "Return the XLA FFI handler of the CUDA allreduce as a PyCapsule.");
  m.def(
      "token_after_handler",
      [] { return EncapsulateFfiHandler(Mpi4jaxDistTokenAfterCuda); },
      "Return the XLA FFI handler that makes a token after a buffer.");
  m.def("mpi_cuda_support", &MpiCudaSupport,
        "Return whether the MPI library says it reads device memory (True or "
        "False), or None where it cannot say, and while MPI is not "
        "initialized or already finalized.");
  m.def(
      "driver_version",
      [] {
        int version = 0;
        if (cudaDriverGetVersion(&version) != cudaSuccess) version = 0;
        return version;
      },
      "Return cudaDriverGetVersion(): the newest CUDA the driver runs (12080 "
      "for 12.8), or 0 where no driver is installed.");
  m.def("set_staging_bytes", &SetStagingBytes, nb::arg("bytes"),
        "Pin staging buffers of `bytes` (two halves) from now on; refused "
        "while buffers of another size exist.");
  m.def(
      "staging_bytes", [] { return mpi4jax_dist::Pool().bytes(); },
      "Return the size of the pinned staging buffers, in bytes.");
  m.def(
      "release_pinned",
      [] {
        nb::gil_scoped_release release;
        return mpi4jax_dist::Pool().Release();
      },
      "Free the idle pinned host staging buffers; return the bytes freed.");
  m.def(
      "stats",
      [] {
        return mpi4jax_dist::StatsDict(
            {mpi4jax_dist::GetStatsItems(), mpi4jax_dist::GetCudaStatsItems()});
      },
      "Return counts of handler calls, the MPI calls they made, and staging.");
  m.def(
      "reset_stats",
      [] {
        mpi4jax_dist::GetStats().Reset();
        mpi4jax_dist::ResetCudaStats();
      },
      "Set every count to zero; pinned_bytes (allocated now) stays.");
  // The CUDA runtime this module was compiled against (13000: CUDA 13.0).
  m.attr("CUDART_VERSION") = CUDART_VERSION;
}
