// The CUDA allreduce's device-side path (ReduceDeviceBuffer in
// mpi4jax_dist/_ffi/cuda_staging.cc) over a CUDA runtime made of host threads,
// as a Python module:
// tests/gpu/test_cuda_fake.py builds it with cuda_staging.cc, links it to the
// install's core (_core), and runs tests/scripts/cuda_fake_job.py under mpiexec
// on the CPU, where there is no GPU.
//
// "Device" memory is host memory the job registers (register_device). A stream
// is a thread that runs the copies queued on it in order, each after a random
// delay of up to delay_us: a handler that let MPI read a staging half before
// its copy came in, wrote a half that a copy back still reads, or gave the
// buffer back with copies in flight, gets wrong numbers. Events, device
// switches, pinned allocations and frees are counted, and a sticky error can be
// set that every wait then returns, as after a kernel that failed.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "cuda_staging.h"
#include "stats.h"

namespace fake {

struct Region {
  const char* begin;
  size_t bytes;
  int device;
};

std::mutex regions_mutex;
std::vector<Region> regions;
thread_local int current_device = 0;
std::atomic<int64_t> set_device_calls{0};
std::atomic<int64_t> host_allocs{0};
std::atomic<int64_t> host_frees{0};
std::atomic<int64_t> copies{0};
// Returned by every stream and event wait while set (0: none).
std::atomic<int> sticky_error{0};
std::atomic<int> delay_us{0};
// A broken event, to show that the job's checks can fail: cudaEventSynchronize
// returns at once.
std::atomic<bool> events_ignored{false};

}  // namespace fake

struct CUstream_st {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::function<void()>> queue;
  uint64_t queued = 0;
  uint64_t done = 0;
  bool stop = false;
  std::thread worker;

  CUstream_st() {
    worker = std::thread([this] {
      std::mt19937 random(std::random_device{}());
      std::unique_lock<std::mutex> lock(mutex);
      while (true) {
        changed.wait(lock, [this] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        std::function<void()> op = std::move(queue.front());
        queue.pop_front();
        lock.unlock();
        const int most = fake::delay_us.load();
        if (most > 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(
              std::uniform_int_distribution<int>(0, most)(random)));
        }
        op();
        lock.lock();
        ++done;
        changed.notify_all();
      }
    });
  }

  ~CUstream_st() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
      changed.notify_all();
    }
    worker.join();
  }

  void Enqueue(std::function<void()> op) {
    std::lock_guard<std::mutex> lock(mutex);
    queue.push_back(std::move(op));
    ++queued;
    changed.notify_all();
  }

  void WaitFor(uint64_t count) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return done >= count; });
  }
};

struct CUevent_st {
  CUstream_st* stream = nullptr;
  uint64_t target = 0;
};

extern "C" {

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    default:
      return "cudaErrorUnknown";
  }
}

const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaErrorIllegalAddress
             ? "an illegal memory access was encountered"
             : "a fake CUDA error";
}

cudaError_t cudaHostAlloc(void** host, size_t size, unsigned int) {
  *host = std::malloc(size);
  if (*host == nullptr) return cudaErrorMemoryAllocation;
  ++fake::host_allocs;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* host) {
  std::free(host);
  ++fake::host_frees;
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  uint64_t queued;
  {
    std::lock_guard<std::mutex> lock(stream->mutex);
    queued = stream->queued;
  }
  stream->WaitFor(queued);
  return static_cast<cudaError_t>(fake::sticky_error.load());
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes,
                                     const void* pointer) {
  std::memset(attributes, 0, sizeof(*attributes));
  attributes->type = cudaMemoryTypeUnregistered;
  attributes->device = -2;
  std::lock_guard<std::mutex> lock(fake::regions_mutex);
  const char* p = static_cast<const char*>(pointer);
  for (const fake::Region& region : fake::regions) {
    if (p >= region.begin && p < region.begin + region.bytes) {
      attributes->type = cudaMemoryTypeDevice;
      attributes->device = region.device;
    }
  }
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = fake::current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  fake::current_device = device;
  ++fake::set_device_calls;
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count,
                            cudaMemcpyKind, cudaStream_t stream) {
  ++fake::copies;
  stream->Enqueue([=] { std::memcpy(dst, src, count); });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  *event = new CUevent_st();
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(stream->mutex);
  event->stream = stream;
  event->target = stream->queued;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event->stream != nullptr && !fake::events_ignored.load()) {
    event->stream->WaitFor(event->target);
  }
  return static_cast<cudaError_t>(fake::sticky_error.load());
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}

}  // extern "C"

namespace {

PyObject* NewStream(PyObject*, PyObject*) {
  return PyLong_FromVoidPtr(new CUstream_st());
}

PyObject* FreeStream(PyObject*, PyObject* args) {
  PyObject* handle = nullptr;
  if (!PyArg_ParseTuple(args, "O", &handle)) return nullptr;
  delete static_cast<CUstream_st*>(PyLong_AsVoidPtr(handle));
  Py_RETURN_NONE;
}

PyObject* RegisterDevice(PyObject*, PyObject* args) {
  PyObject* address = nullptr;
  Py_ssize_t bytes = 0;
  int device = 0;
  if (!PyArg_ParseTuple(args, "Oni", &address, &bytes, &device)) return nullptr;
  std::lock_guard<std::mutex> lock(fake::regions_mutex);
  fake::regions.push_back({static_cast<const char*>(PyLong_AsVoidPtr(address)),
                           static_cast<size_t>(bytes), device});
  Py_RETURN_NONE;
}

PyObject* Configure(PyObject*, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"delay_us", "sticky_error", "events_ignored",
                                "current_device", nullptr};
  int delay = fake::delay_us, sticky = fake::sticky_error;
  int ignored = fake::events_ignored, device = fake::current_device;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iipi",
                                   const_cast<char**>(names), &delay, &sticky,
                                   &ignored, &device)) {
    return nullptr;
  }
  fake::delay_us = delay;
  fake::sticky_error = sticky;
  fake::events_ignored = ignored != 0;
  fake::current_device = device;
  Py_RETURN_NONE;
}

PyObject* Counts(PyObject*, PyObject*) {
  return Py_BuildValue(
      "{s:L,s:L,s:L,s:L,s:i}", "set_device_calls",
      static_cast<long long>(fake::set_device_calls.load()), "host_allocs",
      static_cast<long long>(fake::host_allocs.load()), "host_frees",
      static_cast<long long>(fake::host_frees.load()), "copies",
      static_cast<long long>(fake::copies.load()), "current_device",
      fake::current_device);
}

// reduce(stream, in, out, count, itemsize, dtype, comm, chunk_bytes, aware):
// ReduceDeviceBuffer with MPI.SUM; dtype is "float32", "float64" or "int8";
// comm a Fortran handle (mpi4py's py2f()). Raises RuntimeError with the
// handler's message when it fails.
PyObject* Reduce(PyObject*, PyObject* args) {
  PyObject *stream = nullptr, *in = nullptr, *out = nullptr;
  Py_ssize_t count = 0, itemsize = 0;
  const char* dtype_name = nullptr;
  long long comm_handle = 0, chunk_bytes = 0;
  int aware = 0;
  if (!PyArg_ParseTuple(args, "OOOnnsLLp", &stream, &in, &out, &count,
                        &itemsize, &dtype_name, &comm_handle, &chunk_bytes,
                        &aware)) {
    return nullptr;
  }
  const std::string name = dtype_name;
  MPI_Datatype dtype = name == "float32"   ? MPI_FLOAT
                       : name == "float64" ? MPI_DOUBLE
                       : name == "int8"    ? MPI_INT8_T
                                           : MPI_DATATYPE_NULL;
  if (dtype == MPI_DATATYPE_NULL) {
    PyErr_Format(PyExc_ValueError, "reduce: dtype %s", dtype_name);
    return nullptr;
  }
  const MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(comm_handle));
  const auto* in_data = static_cast<const char*>(PyLong_AsVoidPtr(in));
  auto* out_data = static_cast<char*>(PyLong_AsVoidPtr(out));
  auto* stream_data = static_cast<cudaStream_t>(PyLong_AsVoidPtr(stream));
  xla::ffi::Error error = xla::ffi::Error::Success();
  Py_BEGIN_ALLOW_THREADS
  error = mpi4jax_dist::ReduceDeviceBuffer(
      stream_data, in_data, out_data, static_cast<size_t>(count),
      static_cast<size_t>(itemsize), dtype, MPI_SUM, comm, chunk_bytes,
      aware != 0);
  Py_END_ALLOW_THREADS
  if (error.failure()) {
    PyErr_SetString(PyExc_RuntimeError, error.message().c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// The CUDA module's staging functions and counts, over the same C++ (cuda.cc
// binds them with nanobind; a plain module here, built without it).
PyObject* SetStagingBytes(PyObject*, PyObject* args) {
  unsigned long long bytes = 0;
  if (!PyArg_ParseTuple(args, "K", &bytes)) return nullptr;
  if (bytes < mpi4jax_dist::kMinStagingBytes) {
    PyErr_SetString(PyExc_ValueError, "set_staging_bytes: too few bytes");
    return nullptr;
  }
  if (!mpi4jax_dist::Pool().SetBytes(static_cast<size_t>(bytes))) {
    PyErr_SetString(PyExc_RuntimeError,
                    "set_staging_bytes: buffers of another size exist");
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* StagingBytes(PyObject*, PyObject*) {
  return PyLong_FromSize_t(mpi4jax_dist::Pool().bytes());
}

PyObject* ReleasePinned(PyObject*, PyObject*) {
  return PyLong_FromSize_t(mpi4jax_dist::Pool().Release());
}

PyObject* GetStatsDict(PyObject*, PyObject*) {
  PyObject* dict = PyDict_New();
  if (dict == nullptr) return nullptr;
  for (const mpi4jax_dist::StatsItems& items :
       {mpi4jax_dist::GetStatsItems(), mpi4jax_dist::GetCudaStatsItems()}) {
    for (const auto& [name, value] : items) {
      PyObject* number = PyLong_FromLongLong(value);
      if (number == nullptr || PyDict_SetItemString(dict, name, number) < 0) {
        Py_XDECREF(number);
        Py_DECREF(dict);
        return nullptr;
      }
      Py_DECREF(number);
    }
  }
  return dict;
}

PyObject* ResetStats(PyObject*, PyObject*) {
  mpi4jax_dist::GetStats().Reset();
  mpi4jax_dist::ResetCudaStats();
  Py_RETURN_NONE;
}

PyMethodDef kFakeMethods[] = {
    {"new_stream", NewStream, METH_NOARGS, "A fake stream: its handle."},
    {"free_stream", FreeStream, METH_VARARGS, "End a fake stream."},
    {"register_device", RegisterDevice, METH_VARARGS,
     "register_device(address, bytes, device): fake device memory."},
    // Through void (*)(void), the cast CPython's own modules use for kwargs.
    {"configure",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Configure)),
     METH_VARARGS | METH_KEYWORDS,
     "configure(delay_us=, sticky_error=, events_ignored=, current_device=)."},
    {"counts", Counts, METH_NOARGS, "What the fake runtime was asked to do."},
    {"reduce", Reduce, METH_VARARGS, "ReduceDeviceBuffer with MPI.SUM."},
    // The CUDA module's staging functions and counts.
    {"set_staging_bytes", SetStagingBytes, METH_VARARGS, nullptr},
    {"staging_bytes", StagingBytes, METH_NOARGS, nullptr},
    {"release_pinned", ReleasePinned, METH_NOARGS, nullptr},
    {"stats", GetStatsDict, METH_NOARGS, nullptr},
    {"reset_stats", ResetStats, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kFakeModule = {
    PyModuleDef_HEAD_INIT,
    "_cuda_fake",
    "cuda.cc's device-side path over a fake CUDA runtime, for the tests.",
    -1,
    kFakeMethods,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__cuda_fake(void) { return PyModule_Create(&kFakeModule); }
