/* The Python module _stacks: a rank's stacks written without Python's GIL.

faulthandler writes every thread's Python stack from a signal handler without
the GIL (mpi4jax_dist.faults registers it on SIGUSR1, writing into a pipe).
A Python thread draining that pipe would need the GIL, which a rank stuck in a
long C call holds: this module's thread, plain C, drains it instead, and
writes each dump to MPI4JAX_DIST_HANG_DIR/rank-N.txt (or to stderr as
[rank N] lines) with a header and, once per place, the source line each frame
stands at as its file reads at that moment, for --hangs (stacks_dump.h,
stacks_sources.c).

With answer() the thread also answers the reporting rank's requests for the
stacks on the watchdog's communicator when the rank's Python cannot
(stacks_answer.c): it looks for them every `poll_ms` milliseconds and never
else; without answer() it wakes only for a dump.

With watch_interrupts() it also sees SIGINT (Ctrl-C) come, and where Python
does not act on it within a grace (the rank waits in C) writes the stacks and
ends the job (stacks_interrupt.c).

This file holds the module and its thread; the pieces above are sources of
their own (stacks_dump.c, stacks_sources.c, stacks_answer.c,
stacks_interrupt.c, stacks_text.c) over one header of the module's, stacks.h. */

#define _GNU_SOURCE /* pipe2, pthread_setname_np */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <mpi.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "stacks.h"

static struct {
  pthread_mutex_t mu; /* one dump at a time; guards the MPI calls */
  int wake[2]; /* a byte into wake[1] has the thread look at `answers.on` anew */
} g = {.mu = PTHREAD_MUTEX_INITIALIZER};

/* The thread: a dump from the pipe, a wake-up (answer(), watch_interrupts()),
   a SIGINT, or the time to look for requests again. */
static void *run(void *unused) {
  (void)unused;
  double deadline = 0; /* a SIGINT's grace ends then (0: none) */
  for (;;) {
    /* poll() leaves out a descriptor of -1 (no SIGINT pipe, no socket). */
    struct pollfd p[4] = {{dumps.read_fd, POLLIN, 0},
                          {g.wake[0], POLLIN, 0},
                          {interrupts.pipe[0], POLLIN, 0},
                          {status.listen_fd, POLLIN, 0}};
    int wait_ms = atomic_load(&answers.on) ? answers.poll_ms : -1;
    if (deadline > 0) {
      int left = (int)((deadline - now_s()) * 1000) + 1;
      if (left < 0) left = 0;
      if (wait_ms < 0 || left < wait_ms) wait_ms = left;
    }
    int ready = poll(p, 4, wait_ms);
    if (ready < 0 && errno != EINTR) return NULL;
    int client = ready > 0 && p[3].fd >= 0 && p[3].revents;
    ready -= client;
    if (ready > 0 && p[1].revents) {
      char byte;
      if (read(g.wake[0], &byte, 1) <= 0) return NULL;
      --ready;
    }
    if (ready > 0 && interrupts.pipe[0] >= 0 && p[2].revents) {
      char bytes[64];
      (void)!read(interrupts.pipe[0], bytes, sizeof bytes);
      --ready;
      if (deadline == 0) {
        atomic_store(&interrupts.python_ran, 0);
        Py_AddPendingCall(mark_python_ran, NULL);
        deadline = now_s() + interrupts.grace_s;
      }
    }
    if (deadline > 0 && now_s() >= deadline) {
      deadline = 0;
      if (!atomic_load(&interrupts.python_ran)) {
        pthread_mutex_lock(&g.mu);
        end_interrupted();
        pthread_mutex_unlock(&g.mu);
      }
    }
    pthread_mutex_lock(&g.mu);
    if (ready > 0) {
      if (!(p[0].revents & POLLIN)) {
        pthread_mutex_unlock(&g.mu);
        return NULL; /* the write end is closed */
      }
      struct timespec came;
      clock_gettime(CLOCK_REALTIME, &came);
      Text dump = {0};
      int state = read_dump(&dump);
      char where[PATH_MAX];
      if (dump.size) write_dump(dump.data, "SIGUSR1", &came, NULL, where, sizeof where);
      free(dump.data);
      if (state < 0) {
        pthread_mutex_unlock(&g.mu);
        return NULL;
      }
    }
    if (client && status.listen_fd >= 0) answer_status_client();
    answer_requests();
    answer_status_asks();
    pthread_mutex_unlock(&g.mu);
  }
}

static PyObject *start(PyObject *self, PyObject *args) {
  (void)self;
  int read_fd, rank, size;
  const char *dir, *host;
  unsigned long main_thread;
  if (!PyArg_ParseTuple(args, "iiissk", &read_fd, &rank, &size, &dir, &host,
                        &main_thread)) {
    return NULL;
  }
  if (dumps.read_fd >= 0) Py_RETURN_NONE; /* once a process */
  if (pipe2(g.wake, O_CLOEXEC)) return PyErr_SetFromErrno(PyExc_OSError);
  dumps.read_fd = read_fd;
  dumps.rank = rank;
  dumps.size = size;
  dumps.main_thread = main_thread;
  snprintf(dumps.dir, sizeof dumps.dir, "%s", dir);
  snprintf(dumps.host, sizeof dumps.host, "%s", host);
  pthread_t thread;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  /* No signal reaches this thread but the ones it raises: faulthandler's dump
     of a SIGUSR1 from outside runs in a Python thread (no matter which). */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  int error = pthread_create(&thread, &attr, run, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (error) {
    dumps.read_fd = -1;
    errno = error;
    return PyErr_SetFromErrno(PyExc_OSError);
  }
#ifdef __linux__
  pthread_setname_np(thread, "mpi4jax_stacks");
#endif
  Py_RETURN_NONE;
}

static PyObject *answer(PyObject *self, PyObject *args) {
  (void)self;
  long long handle;
  int signum, tag_ask, tag_reply, tag_status_ask, tag_status_reply;
  double poll_s;
  if (!PyArg_ParseTuple(args, "Liiiiid", &handle, &signum, &tag_ask, &tag_reply,
                        &tag_status_ask, &tag_status_reply, &poll_s)) {
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&g.mu);
  answers.comm = MPI_Comm_f2c((MPI_Fint)handle);
  answers.signum = signum;
  answers.tag_ask = tag_ask;
  answers.tag_reply = tag_reply;
  status.tag_ask = tag_status_ask;
  status.tag_reply = tag_status_reply;
  answers.poll_ms = (int)(poll_s * 1000);
  atomic_store(&answers.on, 1);
  pthread_mutex_unlock(&g.mu);
  if (dumps.read_fd >= 0) write_all(g.wake[1], "", 1); /* poll with the period now */
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *stop_answering(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  Py_BEGIN_ALLOW_THREADS /* waits for a request being answered */
  pthread_mutex_lock(&g.mu);
  atomic_store(&answers.on, 0);
  pthread_mutex_unlock(&g.mu);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *watch_interrupts(PyObject *self, PyObject *args) {
  (void)self;
  int dump_signum;
  double grace_s;
  if (!PyArg_ParseTuple(args, "id", &dump_signum, &grace_s)) return NULL;
  if (dumps.read_fd < 0) {
    PyErr_SetString(PyExc_RuntimeError, "_stacks: start() first");
    return NULL;
  }
  if (interrupts.pipe[0] >= 0) Py_RETURN_NONE; /* once a process */
  if (pipe2(interrupts.pipe, O_CLOEXEC | O_NONBLOCK)) {
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  interrupts.dump_signum = dump_signum;
  interrupts.grace_s = grace_s;
  struct sigaction ours;
  memset(&ours, 0, sizeof ours);
  ours.sa_sigaction = on_sigint;
  ours.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGINT, &ours, &interrupts.python_handler)) {
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  write_all(g.wake[1], "", 1); /* poll the pipe from now on */
  Py_RETURN_NONE;
}

static PyObject *set_in_flight(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *given;
  if (!PyArg_ParseTuple(args, "O", &given)) return NULL;
  /* An extension's capsule, or the address of a C function of that signature
   * (the MPI wrapper's mpi4jax_dist_mpiabi_in_flight, which is no module). */
  void *reader = PyLong_Check(given)
                     ? PyLong_AsVoidPtr(given)
                     : PyCapsule_GetPointer(given, "mpi4jax_dist.in_flight");
  if (reader == NULL) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "set_in_flight: a null address");
    return NULL;
  }
  int n = atomic_load(&answers.readers);
  for (int i = 0; i < n; ++i) {
    if ((void *)answers.in_flight[i] == reader) Py_RETURN_NONE;
  }
  if (n >= (int)(sizeof answers.in_flight / sizeof answers.in_flight[0])) Py_RETURN_NONE;
  answers.in_flight[n] = (size_t(*)(char *, size_t))reader;
  atomic_store(&answers.readers, n + 1);
  Py_RETURN_NONE;
}

static PyObject *set_totals(PyObject *self, PyObject *args) {
  (void)self;
  PyObject *capsule;
  if (!PyArg_ParseTuple(args, "O", &capsule)) return NULL;
  void *reader = PyCapsule_GetPointer(capsule, "mpi4jax_dist.totals");
  if (reader == NULL) return NULL;
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&g.mu);
  status.totals = (void (*)(int64_t *))reader;
  pthread_mutex_unlock(&g.mu);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *listen_status(PyObject *self, PyObject *args) {
  (void)self;
  const char *path, *job, *library;
  int signum;
  if (!PyArg_ParseTuple(args, "ssis", &path, &job, &signum, &library)) {
    return NULL;
  }
  if (dumps.read_fd < 0) {
    PyErr_SetString(PyExc_RuntimeError, "_stacks: start() first");
    return NULL;
  }
  struct sockaddr_un address = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof address.sun_path) {
    PyErr_Format(PyExc_ValueError,
                 "the status socket's path is longer than %d bytes: %s",
                 (int)sizeof address.sun_path - 1, path);
    return NULL;
  }
  if (status.listen_fd >= 0) Py_RETURN_NONE; /* once a process */
  regex_t compiled;
  if (regcomp(&compiled, library, REG_EXTENDED | REG_NOSUB) != 0) {
    PyErr_Format(PyExc_ValueError, "not a POSIX extended regex: %s", library);
    return NULL;
  }
  snprintf(address.sun_path, sizeof address.sun_path, "%s", path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    regfree(&compiled);
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  unlink(path); /* a socket an earlier process of this pid left */
  if (bind(fd, (struct sockaddr *)&address, sizeof address) || listen(fd, 8)) {
    int error = errno;
    close(fd);
    regfree(&compiled);
    errno = error;
    return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
  }
  pthread_mutex_lock(&g.mu);
  snprintf(status.path, sizeof status.path, "%s", path);
  snprintf(status.job, sizeof status.job, "%s", job);
  status.signum = signum;
  /* A process that listens again (after stop_status) compiled the pattern
     anew: the earlier one is freed. */
  if (status.library_set) regfree(&status.library);
  status.library = compiled;
  status.library_set = 1;
  status.listen_fd = fd;
  pthread_mutex_unlock(&g.mu);
  write_all(g.wake[1], "", 1); /* poll the socket from now on */
  Py_RETURN_NONE;
}

static PyObject *stop_status(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  Py_BEGIN_ALLOW_THREADS /* waits for a client being answered */
  pthread_mutex_lock(&g.mu);
  if (status.listen_fd >= 0) {
    close(status.listen_fd);
    unlink(status.path);
    status.listen_fd = -1;
  }
  pthread_mutex_unlock(&g.mu);
  if (dumps.read_fd >= 0) write_all(g.wake[1], "", 1);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *write_stacks(PyObject *self, PyObject *args) {
  (void)self;
  const char *dump, *reason;
  if (!PyArg_ParseTuple(args, "ss", &dump, &reason)) return NULL;
  char where[PATH_MAX];
  struct timespec came;
  clock_gettime(CLOCK_REALTIME, &came);
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&g.mu);
  write_dump(dump, reason, &came, NULL, where, sizeof where);
  pthread_mutex_unlock(&g.mu);
  Py_END_ALLOW_THREADS
  return PyUnicode_DecodeFSDefault(where);
}

static PyObject *library_version(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(text, &length) != MPI_SUCCESS) {
    PyErr_SetString(PyExc_RuntimeError, "MPI_Get_library_version failed");
    return NULL;
  }
  return PyUnicode_DecodeUTF8(text, length, "replace");
}

static PyMethodDef methods[] = {
    {"start", start, METH_VARARGS,
     "start(read_fd, rank, size, directory, host, main_thread): write each dump "
     "faulthandler writes into the pipe's other end (directory '': stderr)."},
    {"answer", answer, METH_VARARGS,
     "answer(fortran_comm, signum, tag_ask, tag_reply, tag_status_ask, "
     "tag_status_reply, poll_s): answer rank 0's requests for stacks and any "
     "rank's for its status line on the communicator, dumping on signum."},
    {"listen_status", listen_status, METH_VARARGS,
     "listen_status(path, job, signum, library): answer `python -m "
     "mpi4jax_dist status` on a Unix socket at path, dumping on signum (0: no "
     "Python line) and looking past frames whose path matches library (a "
     "POSIX extended regex)."},
    {"stop_status", stop_status, METH_NOARGS,
     "Close the status socket and remove its file."},
    {"set_totals", set_totals, METH_VARARGS,
     "set_totals(capsule): read the record's totals (an extension's "
     "totals_reader()) for the status lines."},
    {"stop_answering", stop_answering, METH_NOARGS,
     "Make no MPI call more (before MPI_Finalize)."},
    {"watch_interrupts", watch_interrupts, METH_VARARGS,
     "watch_interrupts(dump_signum, grace_s): after a SIGINT that Python does "
     "not act on within grace_s (it waits in C), write the stacks (dumping on "
     "dump_signum; 0: none) and end the job with MPI_Abort."},
    {"set_in_flight", set_in_flight, METH_VARARGS,
     "set_in_flight(reader): quote the calls a record says the rank is in "
     "in each reply; reader is an extension's in_flight_reader() capsule or "
     "the address of a C function size_t(char *out, size_t capacity)."},
    {"write", write_stacks, METH_VARARGS,
     "write(dump, reason): write a dump as the thread does; return where."},
    {"library_version", library_version, METH_NOARGS,
     "Return MPI_Get_library_version() of the MPI this module calls."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_stacks",
    .m_doc = "A rank's stacks written without Python's GIL (stacks.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__stacks(void) {
  PyObject *m = PyModule_Create(&module);
  if (m != NULL) {
    /* The MPI of the headers, named as mpi_base.h's HeaderMpiLibrary does. */
    PyModule_AddStringConstant(m, "HEADER_MPI",
#if defined(OMPI_MAJOR_VERSION)
                               "Open MPI"
#elif defined(I_MPI_VERSION) /* before MPICH: Intel's mpi.h defines both */
                               "Intel(R) MPI Library " I_MPI_VERSION
#elif defined(MPICH_VERSION)
                               "MPICH " MPICH_VERSION
#else
                               "MPI"
#endif
    );
  }
  return m;
}
