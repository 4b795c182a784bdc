// Communicators as compiled code names them: Python registers each one
// (register_comm) and the compiled call carries its id, which MPI's attribute
// delete callback marks freed with the communicator.
//
// The calls run on a private duplicate of the user's communicator, made on the
// first call (MPI_Comm_idup, polled under the collective timeout): the
// package's messages never meet the user's own mpi4py or mpi4jax calls on it,
// and MPI's errors there are returned (MPI_ERRORS_RETURN), so that a failed
// call is an error naming the call rather than MPI aborting the job.

#ifndef MPI4JAX_DIST_FFI_COMM_REGISTRY_H_
#define MPI4JAX_DIST_FFI_COMM_REGISTRY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mpi_base.h"

namespace mpi4jax_dist {

class MPI4JAX_DIST_CORE_API CommRegistry {
 public:
  struct Entry {
    MPI_Comm comm = MPI_COMM_NULL;  // the user's
    std::string name;               // "communicator 'NAME' (P ranks)"
    int size = 0;                   // P
    std::atomic<bool> freed{false};
    // The calls entered on it in this process (allreduce, iallreduce's
    // start): each call's number, and the collective timeout's report.
    std::atomic<int64_t> calls{0};
    // The private duplicates: made by the first call that needs them
    // (PrivateComm). `dup` carries the calls, `explain` a disagreement's
    // explanation (agreement.h), apart from a call that may stay pending.
    std::mutex dup_mu;
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Comm explain = MPI_COMM_NULL;
    MPI_Request dup_requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    std::atomic<int> dup_state{0};  // 0 none, 1 being made, 2 ready
    // The call whose ranks disagreed (0: none): MPI may still hold a request
    // of it on `dup`, so no later call may use it.
    std::atomic<int64_t> broken_at{0};
    // The communicator as every member names it alike: its group (GroupHash),
    // and once its duplicates are made, which of that group's (MadeKey; 0
    // before).
    uint64_t group_hash = 0;
    std::atomic<uint64_t> global_key{0};
    // The handlers running a call on it now (Turn, allreduce.h): more than one
    // means programs that nothing orders against each other.
    std::atomic<int> active{0};
  };

  // The process's registry, the core's. Never destroyed: MPI may call the
  // delete callback at MPI_Finalize, from an atexit handler, after static
  // destructors could have run.
  static CommRegistry& Get();

  // The id of the communicator of Fortran handle `handle`, registering it
  // first if it is new. MPI must be usable (CheckMpiUsable).
  ffi::Error Register(int64_t handle, int64_t* id,
                      const char* who = kAllreduceName);

  // The live entry of `id`, or an error naming what is wrong.
  ffi::Error Find(int64_t id, Entry** out, const char* who = kAllreduceName);

  // Count a call entered on `id` (found live by Find); return its number.
  int64_t CountCall(int64_t id);

  // The communicator `id` as every member names it (Entry::global_key; until
  // its first call has made its duplicates, its group's hash with the low bit
  // cleared: alike on every member then too, and never a made key), as the
  // reports do, and its size; 0, "" and 0 for an id never registered.
  struct Description {
    uint64_t key = 0;
    std::string name;
    int size = 0;
  };
  Description Describe(int64_t id);

  // Every registered communicator's count of calls, by id (index id - 1).
  std::vector<int64_t> CallCounts();

 private:
  // MPI's attribute delete callback: the communicator is being freed (or MPI
  // finalized, for COMM_WORLD and COMM_SELF). Its duplicate is freed at the
  // next registration, outside MPI's callback.
  static int OnFree(MPI_Comm comm, int, void* value, void*);

  // Free the duplicates of freed communicators (mu_ and the MPI lock held).
  void FreeRetired();

  std::mutex mu_;
  int keyval_ = MPI_KEYVAL_INVALID;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::vector<Entry*> retired_;
};

// The private duplicates of `entry`'s communicator: made on first use (every
// rank's first call on it makes them with it, as MPI requires). With `block`
// the making is waited for, polled under this thread's call deadline (the
// collective timeout); without, *ready says whether they are there yet.
MPI4JAX_DIST_CORE_API ffi::Error PrivateComm(CommRegistry::Entry& entry,
                                             bool block, MPI_Comm* dup,
                                             bool* ready, const char* who);

}  // namespace mpi4jax_dist

#endif  // MPI4JAX_DIST_FFI_COMM_REGISTRY_H_
