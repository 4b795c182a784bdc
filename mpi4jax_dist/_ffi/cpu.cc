// The CPU handlers of mpi4jax_dist.allreduce and of the non-blocking
// mpi4jax_dist.iallreduce (start, test, wait, overlap's tie), and the Python
// module _cpu that hands them to JAX (jax.ffi.register_ffi_target).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "allreduce.h"
#include "iallreduce.h"
#include "module_common.h"
#include "request_table.h"
#include "stats.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mpi4jax_dist {
namespace {

// x and a token in, the reduced x out (aliased with x by the lowering). The
// token orders the call after every earlier MPI call of the program: XLA:CPU
// otherwise runs thunks concurrently, ordered only by data. The next call's
// token comes from TokenAfter(y) below. `comm` is the communicator's id in
// the CommRegistry; `check` 0 leaves out the check against the other ranks'
// calls (MPI4JAX_DIST_CHECKS=0); `site` is where the user made the call
// (Record::RegisterSite).
ffi::Error AllreduceCpuImpl(ffi::AnyBuffer x, ffi::Token,
                            ffi::Result<ffi::AnyBuffer> y, int64_t comm_id,
                            int32_t op_code, int64_t chunk_bytes, int32_t check,
                            int64_t site) {
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
  const size_t count = x.element_count();
  return AllreduceHost(call, x.untyped_data(), y->untyped_data(), count,
                       count ? x.size_bytes() / count : 1, chunk_bytes,
                       check != 0);
}

// The non-blocking allreduce (iallreduce.h has the logic). The start: x and a
// token in; x (aliased) and the request's handle out, once MPI_Iallreduce is
// posted. The test and the wait take x and the handle back (x aliased), and
// after them the results of the work placed before them (RemainingArgs): never
// read, they make XLA:CPU's runtime, which orders thunks only by the buffers
// they use, run that work before the test or wait.
ffi::Error IallreduceStartCpuImpl(ffi::AnyBuffer x, ffi::Token,
                                  ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::BufferR0<ffi::S32>> handle,
                                  int64_t comm_id, int32_t op_code,
                                  int32_t check, int64_t uid, int64_t site) {
  return IallreduceStart(x, *y, comm_id, op_code, check != 0, uid, site,
                         handle->typed_data());
}

ffi::Error IallreduceTestCpuImpl(
    ffi::AnyBuffer x, ffi::BufferR0<ffi::S32> handle, ffi::Token,
    ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> y,
    ffi::Result<ffi::BufferR0<ffi::S32>> handle_out) {
  const int32_t h = *handle.typed_data();
  *handle_out->typed_data() = h;
  // Aliased, XLA hands one buffer; were it ever two, pass the values on.
  if (x.untyped_data() != y->untyped_data() && x.size_bytes() > 0) {
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  return IallreduceTest(h);
}

ffi::Error IallreduceWaitCpuImpl(ffi::AnyBuffer, ffi::BufferR0<ffi::S32> handle,
                                 ffi::Token, ffi::RemainingArgs,
                                 ffi::Result<ffi::AnyBuffer> y) {
  return IallreduceWait(*y, *handle.typed_data());
}

// The tie of Request.overlap: the request's handle and arrays in, the
// same arrays out (aliased, in place). No work: the arrays the overlapped work
// reads are then written by a call that comes after the start (or test) that
// wrote the handle, a dependency that XLA keeps through its passes (unlike an
// optimization barrier, which XLA:CPU removes before scheduling) and that its
// runtime, ordering thunks by the buffers they use, honours too.
ffi::Error IallreduceTieCpuImpl(ffi::BufferR0<ffi::S32>,
                                ffi::RemainingArgs args,
                                ffi::RemainingRets rets) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "mpi4jax_dist.Request.overlap: the tie has " +
        std::to_string(args.size()) + " arrays in but " +
        std::to_string(rets.size()) + " out");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> in = args.get<ffi::AnyBuffer>(i);
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!out.has_value()) return out.error();
    // Aliased, XLA hands one buffer; were it ever two, pass the values on.
    if (in->untyped_data() != (*out)->untyped_data() && in->size_bytes() > 0) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace mpi4jax_dist

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceTieCpu,
                              mpi4jax_dist::IallreduceTieCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceStartCpu,
                              mpi4jax_dist::IallreduceStartCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("check")
                                  .Attr<int64_t>("uid")
                                  .Attr<int64_t>("site"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceTestCpu,
                              mpi4jax_dist::IallreduceTestCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Token>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistIallreduceWaitCpu,
                              mpi4jax_dist::IallreduceWaitCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()
                                  .Arg<xla::ffi::Token>()
                                  .RemainingArgs()
                                  .Ret<xla::ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mpi4jaxDistAllreduceCpu,
                              mpi4jax_dist::AllreduceCpuImpl,
                              xla::ffi::Ffi::Bind()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Token>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("chunk_bytes")
                                  .Attr<int32_t>("check")
                                  .Attr<int64_t>("site"));

// The token after the allreduce: mpi4jax_dist::TokenAfterImpl (allreduce.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Mpi4jaxDistTokenAfterCpu, mpi4jax_dist::TokenAfterImpl,
    xla::ffi::Ffi::Bind().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::Token>());

// ---------------------------------------------------------------------------
// The Python module: the handlers as capsules, what the MPI is, the counts,
// and the non-blocking allreduce's requests in flight.

namespace {

namespace nb = nanobind;

// Requests as (handle, uid, site) tuples.
nb::list InfoList(const std::vector<mpi4jax_dist::RequestTable::Info>& infos) {
  nb::list list;
  for (const auto& info : infos) {
    list.append(nb::make_tuple(info.handle, info.uid, info.site));
  }
  return list;
}

}  // namespace

NB_MODULE(_cpu, m) {
  using mpi4jax_dist::EncapsulateFfiHandler;
  m.doc() =
      "mpi4jax_dist's XLA FFI handlers for the CPU, built against one MPI.";
  mpi4jax_dist::DefineCommon(m);
  m.def(
      "allreduce_handler",
      [] { return EncapsulateFfiHandler(Mpi4jaxDistAllreduceCpu); },
      "Return the XLA FFI handler of the CPU allreduce as a PyCapsule.");
  m.def(
      "token_after_handler",
      [] { return EncapsulateFfiHandler(Mpi4jaxDistTokenAfterCpu); },
      "Return the XLA FFI handler that makes a token after a buffer.");
  m.def(
      "iallreduce_handlers",
      [] {
        return nb::make_tuple(
            EncapsulateFfiHandler(Mpi4jaxDistIallreduceStartCpu),
            EncapsulateFfiHandler(Mpi4jaxDistIallreduceTestCpu),
            EncapsulateFfiHandler(Mpi4jaxDistIallreduceWaitCpu),
            EncapsulateFfiHandler(Mpi4jaxDistIallreduceTieCpu));
      },
      "Return the XLA FFI handlers of the non-blocking allreduce's start, "
      "test, wait and overlap's tie as PyCapsules.");
  m.def(
      "stats",
      [] {
        return mpi4jax_dist::StatsDict({mpi4jax_dist::GetStatsItems(),
                                        mpi4jax_dist::GetRequestStatsItems()});
      },
      "Return counts of handler calls and the MPI calls they made.");
  m.def(
      "reset_stats",
      [] {
        mpi4jax_dist::GetStats().Reset();
        mpi4jax_dist::GetRequestStats().Reset();
      },
      "Set every count to zero.");
  m.def(
      "pending_requests",
      [] { return InfoList(mpi4jax_dist::RequestTable::Get().Pending()); },
      "Return the non-blocking allreduce's requests in flight as (handle, uid, "
      "site) tuples.");
  m.def(
      "complete_pending",
      [](const std::vector<int32_t>& handles, double timeout_s) {
        std::vector<mpi4jax_dist::RequestTable::Info> left;
        {
          nb::gil_scoped_release release;
          left = mpi4jax_dist::CompletePending(handles, timeout_s);
        }
        return InfoList(left);
      },
      nb::arg("handles"), nb::arg("timeout_s"),
      "Complete the pending requests of `handles` (all when empty) by polling "
      "MPI_Test for at most `timeout_s` seconds (CompletePending in "
      "iallreduce.h); return those left pending as (handle, uid, site).");
}
