/* The Python module _stacks: a rank's stacks written without Python's GIL.

faulthandler writes every thread's Python stack from a signal handler without
the GIL (mpi4jax_dist.faults.hangs registers it on SIGUSR1, writing into a
pipe). A Python thread draining that pipe would need the GIL, which a rank
stuck in a long C call holds: this module's thread, plain C, drains it instead,
and writes each dump to MPI4JAX_DIST_HANG_DIR/rank-N.txt (or to stderr as
[rank N] lines) with a header (rank, host, pid, when the dump came and when it
was written, why) and, once per place, the source line each frame stands at as
its file reads at that moment (# line PATH:N: TEXT), for --hangs.

With answer() the thread also answers the reporting rank (rank 0, or its
deputy where rank 0's watchdog cannot run) on the watchdog's communicator when
the rank's Python cannot: each request (tag `ask`, the dump's reason as text)
raises the signal, so that faulthandler dumps into the pipe, and the dump goes
back to the asker (tag `reply`: where it was written, a newline, the calls the
extensions' records say the rank is in, a newline, the dump). It looks for
requests every `poll_ms` milliseconds (MPI_Improbe, a local call) and never
else; without answer() it wakes only for a dump.

With watch_interrupts() it also sees SIGINT (Ctrl-C) come: a handler in front
of Python's writes a byte into a pipe and calls Python's. Python raises
KeyboardInterrupt only once its main thread runs bytecode again, which a rank
waiting in C (an MPI collective, a jitted program) never does: where it has
not run any `grace` seconds after the signal, the thread writes the rank's
stacks (as for SIGUSR1) and one line, and ends the job with MPI_Abort(130). */

#define _GNU_SOURCE /* pipe2, pthread_setname_np, mkostemp */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <mpi.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* A dump is whole once its pipe has been quiet this long. */
enum { QUIET_MS = 50, MAX_PLACES = 512, REASON_BYTES = 1024, PROBES = 4 };

static struct {
  pthread_mutex_t mu; /* one dump at a time; guards the MPI calls below */
  int read_fd;
  int wake[2]; /* a byte into wake[1] has the thread look at `answering` anew */
  int rank, size;
  char dir[PATH_MAX]; /* "": stderr */
  char host[256];
  unsigned long main_thread;
  /* answer(): the watchdog's communicator, the signal faulthandler dumps on,
     the tags and the period of the look for requests. */
  atomic_int answering;
  MPI_Comm comm;
  int signum, tag_ask, tag_reply, poll_ms;
  /* watch_interrupts(): the pipe the SIGINT handler writes into (-1: none),
     Python's handler, the signal faulthandler dumps on, the grace, and
     whether Python has run since the last SIGINT (a pending call sets it). */
  int interrupts[2];
  struct sigaction python_sigint;
  int dump_signum;
  double grace_s;
  atomic_int python_ran;
  /* set_in_flight(): the readers of the calls the rank is in (the
     extensions' Record::InFlightText, the MPI wrapper's record of XLA's
     calls), quoted in a reply for a rank whose Python cannot answer. */
  size_t (*in_flight[4])(char *out, size_t capacity);
  atomic_int readers;
} g = {.mu = PTHREAD_MUTEX_INITIALIZER, .read_fd = -1, .interrupts = {-1, -1}};

/* A growing byte string. */
typedef struct {
  char *data;
  size_t size, capacity;
} Text;

static void add(Text *t, const char *s, size_t n) {
  if (t->size + n + 1 > t->capacity) {
    size_t capacity = t->capacity ? t->capacity : 4096;
    while (capacity < t->size + n + 1) capacity *= 2;
    char *data = realloc(t->data, capacity);
    if (data == NULL) return; /* out of memory: the dump loses this piece */
    t->data = data;
    t->capacity = capacity;
  }
  memcpy(t->data + t->size, s, n);
  t->size += n;
  t->data[t->size] = '\0';
}

static void addf(Text *t, const char *format, ...) {
  char buffer[PATH_MAX + 2 * REASON_BYTES];
  va_list args;
  va_start(args, format);
  int n = vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  if (n > 0) add(t, buffer, (size_t)n < sizeof buffer ? (size_t)n : sizeof buffer - 1);
}

/* 2026-12-05T00:01:02.345+0000 */
static void format_time(const struct timespec *t, char *out, size_t capacity) {
  struct tm tm;
  char base[32], zone[8];
  localtime_r(&t->tv_sec, &tm);
  strftime(base, sizeof base, "%Y-%m-%dT%H:%M:%S", &tm);
  strftime(zone, sizeof zone, "%z", &tm);
  snprintf(out, capacity, "%s.%03ld%s", base, t->tv_nsec / 1000000, zone);
}

/* Read one dump from the pipe: what is there now and what follows until the
   pipe is quiet. Returns -1 when the pipe is closed or broken. */
static int read_dump(Text *t) {
  char buffer[65536];
  for (;;) {
    ssize_t n = read(g.read_fd, buffer, sizeof buffer);
    if (n > 0) {
      add(t, buffer, (size_t)n);
    } else if (n == 0) {
      return -1;
    } else if (errno != EINTR && errno != EAGAIN) {
      return -1;
    }
    struct pollfd p = {g.read_fd, POLLIN, 0};
    int ready = poll(&p, 1, QUIET_MS);
    if (ready == 0) return 0;
    if (ready < 0 && errno != EINTR) return -1;
  }
}

/* Line `line` (from 1) of `path`, without its surrounding blanks; "" if none. */
static void source_line(const char *path, long line, char *out, size_t capacity) {
  out[0] = '\0';
  FILE *file = fopen(path, "r");
  if (file == NULL) return;
  char *text = NULL;
  size_t length = 0;
  for (long n = 1; getline(&text, &length, file) != -1; ++n) {
    if (n < line) continue;
    char *start = text, *end = text + strlen(text);
    while (*start == ' ' || *start == '\t') ++start;
    while (end > start && (end[-1] == '\n' || end[-1] == '\r' ||
                           end[-1] == ' ' || end[-1] == '\t')) {
      --end;
    }
    snprintf(out, capacity, "%.*s", (int)(end - start), start);
    break;
  }
  free(text);
  fclose(file);
}

/* `# line PATH:N: TEXT` for each place a frame of the dump stands at (faulthandler's
   `  File "PATH", line N in FUNCTION`), once per place. */
static void add_source_lines(Text *out, const char *dump) {
  static const char kFile[] = "File \"", kLine[] = "\", line ";
  struct { const char *path; size_t length; long line; } places[MAX_PLACES];
  int count = 0;
  for (const char *at = dump; *at && count < MAX_PLACES;) {
    const char *end = strchr(at, '\n');
    if (end == NULL) end = at + strlen(at);
    const char *p = at;
    while (p < end && *p == ' ') ++p;
    if ((size_t)(end - p) > sizeof kFile && !strncmp(p, kFile, sizeof kFile - 1)) {
      const char *path = p + sizeof kFile - 1;
      const char *mark = strstr(path, kLine);
      if (mark != NULL && mark < end) {
        long line = strtol(mark + sizeof kLine - 1, NULL, 10);
        size_t length = (size_t)(mark - path);
        int seen = 0;
        for (int i = 0; i < count && !seen; ++i) {
          seen = places[i].line == line && places[i].length == length &&
                 !strncmp(places[i].path, path, length);
        }
        if (!seen) {
          places[count].path = path;
          places[count].length = length;
          places[count].line = line;
          ++count;
        }
      }
    }
    at = *end ? end + 1 : end;
  }
  for (int i = 0; i < count; ++i) {
    char path[PATH_MAX], text[1024];
    if (places[i].length >= sizeof path) continue;
    snprintf(path, sizeof path, "%.*s", (int)places[i].length, places[i].path);
    source_line(path, places[i].line, text, sizeof text);
    if (text[0]) addf(out, "# line %s:%ld: %s\n", path, places[i].line, text);
  }
}

static int write_all(int fd, const char *data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    data += n;
    size -= (size_t)n;
  }
  return 0;
}

/* mkdir -p, the folders it makes private (0700): stacks show the program's
   paths and source lines, and a shared parent (/tmp, a project's scratch)
   should not let others read them or plant files among them. */
static void make_dirs(const char *dir) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s", dir);
  for (char *p = path + 1; *p; ++p) {
    if (*p != '/') continue;
    *p = '\0';
    mkdir(path, 0700);
    *p = '/';
  }
  mkdir(path, 0700);
}

/* The dump less the package's own threads: a block of faulthandler's
   ("Thread 0x... (most recent call first):", its frames, a blank line) of a
   thread other than the main one whose innermost frame is in
   mpi4jax_dist/faults/ (the watchdog, which asks for the dump or answers) is
   one line saying so. The main thread is kept whatever it runs. */
static void leave_out_own_threads(const char *dump, Text *out) {
  for (const char *block = dump; *block;) {
    const char *next = strstr(block, "\n\n");
    size_t length = next ? (size_t)(next - block) + 2 : strlen(block);
    const char *id = strstr(block, "hread 0x");
    const char *line_end = strchr(block, '\n');
    const char *frame = line_end ? line_end + 1 : NULL;
    const char *frame_end = frame ? strchr(frame, '\n') : NULL;
    int own = 0;
    if (id != NULL && line_end != NULL && id < line_end && frame != NULL &&
        frame < block + length) {
      unsigned long thread = strtoul(id + strlen("hread "), NULL, 16);
      size_t frame_length =
          frame_end ? (size_t)(frame_end - frame) : strlen(frame);
      char innermost[1024];
      snprintf(innermost, sizeof innermost, "%.*s", (int)frame_length, frame);
      own = thread != g.main_thread &&
            strstr(innermost, "/mpi4jax_dist/faults/") != NULL;
    }
    if (own) {
      const char *paren = strstr(block, " (most recent");
      int header = paren && paren < line_end ? (int)(paren - block)
                                             : (int)(line_end - block);
      addf(out, "%.*s: mpi4jax_dist's watchdog, its frames left out\n%s",
           header, block, next ? "\n" : "");
    } else {
      add(out, block, length);
    }
    block += length;
  }
}

/* Write a dump, which came at `came`, with its header and without the
   package's own threads (leave_out_own_threads): into the hang directory
   (a file written whole, then renamed over rank-N.txt: a reader sees a whole
   dump or the one before), else on stderr. `whole` receives the header and the
   dump (NULL: not wanted); `where` the directory or "stderr". */
static void write_dump(const char *whole_dump, const char *reason,
                       const struct timespec *came, Text *whole, char *where,
                       size_t where_capacity) {
  Text kept = {0};
  leave_out_own_threads(whole_dump, &kept);
  const char *dump = kept.data ? kept.data : "";
  struct timespec now;
  char came_text[64], now_text[64];
  clock_gettime(CLOCK_REALTIME, &now);
  format_time(came, came_text, sizeof came_text);
  format_time(&now, now_text, sizeof now_text);
  Text header = {0};
  addf(&header, "mpi4jax_dist stacks: rank %d of %d\n", g.rank, g.size);
  addf(&header, "host %s pid %ld signal %s written %s reason %s\n", g.host,
       (long)getpid(), came_text, now_text, reason);
  addf(&header, "main thread 0x%016lx\n", g.main_thread);
  Text file = {0};
  for (char *line = header.data; line && *line;) {
    char *end = strchr(line, '\n');
    addf(&file, "# %.*s\n", (int)(end - line), line);
    line = end + 1;
  }
  add(&file, dump, strlen(dump));
  if (file.size && file.data[file.size - 1] != '\n') add(&file, "\n", 1);
  Text sources = {0};
  if (g.dir[0] || whole != NULL) add_source_lines(&sources, dump);
  snprintf(where, where_capacity, "stderr");
  if (g.dir[0]) {
    char path[PATH_MAX + 32], partial[PATH_MAX + 64];
    make_dirs(g.dir);
    snprintf(path, sizeof path, "%s/rank-%d.txt", g.dir, g.rank);
    /* A new file of a name nobody can foresee (mkstemp: O_CREAT | O_EXCL, mode
       0600), never one found there: a link planted in a shared folder under a
       name we would use must not have us truncate its target. rename()
       replaces a link at `path` itself, never what it points to. */
    snprintf(partial, sizeof partial, "%s/.rank-%d.txt.XXXXXX", g.dir, g.rank);
    int fd = mkostemp(partial, O_CLOEXEC);
    int failed = fd < 0;
    if (!failed) {
      failed = write_all(fd, file.data, file.size) ||
               (sources.size && write_all(fd, sources.data, sources.size));
      failed = close(fd) || failed;
      failed = failed || rename(partial, path);
    }
    if (!failed) {
      snprintf(where, where_capacity, "%s", g.dir);
    } else {
      const int error = errno;
      if (fd >= 0) unlink(partial); /* ours: made by mkostemp above */
      fprintf(stderr,
              "[rank %d] mpi4jax_dist: could not write %s (%s): the stacks "
              "follow.\n",
              g.rank, path, strerror(error));
    }
  }
  if (!strcmp(where, "stderr")) {
    /* [rank N] before each line; the header's three lines as one. */
    Text out = {0};
    char *first = header.data, *second = strchr(first, '\n') + 1;
    char *third = strchr(second, '\n') + 1;
    addf(&out, "[rank %d] %.*s (%.*s; %.*s):\n", g.rank,
         (int)(second - first - 1), first, (int)(third - second - 1), second,
         (int)strcspn(third, "\n"), third);
    for (const char *line = dump; *line;) {
      const char *end = strchr(line, '\n');
      size_t length = end ? (size_t)(end - line) : strlen(line);
      addf(&out, "[rank %d] %.*s\n", g.rank, (int)length, line);
      line += length + (end ? 1 : 0);
    }
    write_all(2, out.data, out.size); /* one write where the pipe takes it */
    free(out.data);
  }
  if (whole != NULL) {
    add(whole, file.data, file.size);
    if (sources.size) add(whole, sources.data, sources.size);
  }
  free(sources.data);
  free(header.data);
  free(file.data);
  free(kept.data);
}

/* Raise `signum` (0: none) here, so that faulthandler dumps into the pipe, and
   read the dump into `dump`. This thread blocks every signal (start): the one
   is let through, so that faulthandler's handler runs here, before raise
   returns. */
static void dump_on(int signum, Text *dump) {
  if (signum <= 0) return;
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, signum);
  pthread_sigmask(SIG_UNBLOCK, &one, NULL);
  int raised = raise(signum) == 0;
  pthread_sigmask(SIG_BLOCK, &one, NULL);
  if (raised) read_dump(dump);
}

/* The reporter's requests (rank 0's, or its deputy's), answered (with g.mu
   held): a dump on the signal, written, and sent back to the asker. */
static void answer_requests(void) {
  while (atomic_load(&g.answering)) {
    int found = 0;
    MPI_Message message;
    MPI_Status status;
    /* A message that has come may take more than one call's progress to be
       matched (MPICH 5's shared memory): a few calls a look. */
    for (int tries = 0; tries < PROBES && !found; ++tries) {
      if (MPI_Improbe(MPI_ANY_SOURCE, g.tag_ask, g.comm, &found, &message,
                      &status) != MPI_SUCCESS) {
        return;
      }
    }
    if (!found) return;
    int count = 0;
    MPI_Get_count(&status, MPI_CHAR, &count);
    char reason[REASON_BYTES] = "";
    char *text = malloc((size_t)count + 1);
    if (text == NULL) return; /* out of memory: rank 0 hears nothing from here */
    MPI_Mrecv(text, count, MPI_CHAR, &message, MPI_STATUS_IGNORE);
    snprintf(reason, sizeof reason, "%.*s", count, text);
    free(text);
    struct timespec came;
    clock_gettime(CLOCK_REALTIME, &came);
    Text dump = {0}, whole = {0};
    dump_on(g.signum, &dump);
    if (dump.size == 0) {
      static const char kNone[] =
          "(no stacks: faulthandler is not registered on a signal here)\n";
      add(&dump, kNone, sizeof kNone - 1);
    }
    char where[PATH_MAX];
    write_dump(dump.data, reason, &came, &whole, where, sizeof where);
    Text reply = {0};
    addf(&reply, "%s\n", where);
    /* The calls the record says the rank is in, one line ("" for none). */
    char calls[2048] = "";
    size_t used = 0;
    for (int i = 0; i < atomic_load(&g.readers); ++i) {
      char one[1024];
      if (g.in_flight[i](one, sizeof one) == 0) continue;
      int n = snprintf(calls + used, sizeof calls - used, "%s%s",
                       used ? "; " : "", one);
      if (n < 0) break;
      used += (size_t)n;
      if (used >= sizeof calls) {
        used = sizeof calls - 1;
        break;
      }
    }
    for (char *c = calls; *c; ++c) {
      if (*c == '\n') *c = ' ';
    }
    addf(&reply, "%s\n", calls);
    add(&reply, whole.data, whole.size);
    MPI_Send(reply.data, (int)reply.size, MPI_CHAR, status.MPI_SOURCE,
             g.tag_reply, g.comm);
    free(dump.data);
    free(whole.data);
    free(reply.data);
  }
}

/* SIGINT: a byte for the thread, then Python's handler (async-signal-safe). */
static void on_sigint(int signum, siginfo_t *info, void *context) {
  int saved = errno;
  char byte = 'I';
  (void)!write(g.interrupts[1], &byte, 1);
  const struct sigaction *py = &g.python_sigint;
  if (py->sa_flags & SA_SIGINFO) {
    if (py->sa_sigaction != NULL) py->sa_sigaction(signum, info, context);
  } else if (py->sa_handler != SIG_IGN && py->sa_handler != SIG_DFL) {
    py->sa_handler(signum);
  }
  errno = saved;
}

/* A pending call: the main thread has run bytecode since it was added. */
static int mark_python_ran(void *unused) {
  (void)unused;
  atomic_store(&g.python_ran, 1);
  return 0;
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The grace after a SIGINT has passed and Python has not run: the stacks, one
   line, and the end of the job (g.mu held). */
static void end_interrupted(void) {
  struct timespec came;
  clock_gettime(CLOCK_REALTIME, &came);
  Text dump = {0};
  dump_on(g.dump_signum, &dump);
  char where[PATH_MAX] = "";
  if (dump.size) {
    write_dump(dump.data, "SIGINT, and Python did not run", &came, NULL, where,
               sizeof where);
  }
  free(dump.data);
  fprintf(stderr,
          "mpi4jax_dist: rank %d of %d: interrupted (SIGINT), and its Python "
          "has not run for %g s since: it waits in C (its stacks: %s); "
          "MPI_Abort ends the job.\n",
          g.rank, g.size, g.grace_s, where[0] ? where : "none");
  fflush(stderr);
  /* Every rank got the signal at once (the terminal's process group, or the
     launcher passing it on): a moment for the others to write theirs before
     this abort ends them. */
  struct timespec pause = {1, 0};
  nanosleep(&pause, NULL);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) _exit(128 + SIGINT); /* no MPI left to end the others */
  MPI_Abort(MPI_COMM_WORLD, 128 + SIGINT);
}

static void *run(void *unused) {
  (void)unused;
  double deadline = 0; /* a SIGINT's grace ends then (0: none) */
  for (;;) {
    struct pollfd p[3] = {{g.read_fd, POLLIN, 0},
                          {g.wake[0], POLLIN, 0},
                          {g.interrupts[0], POLLIN, 0}};
    int wait_ms = atomic_load(&g.answering) ? g.poll_ms : -1;
    if (deadline > 0) {
      int left = (int)((deadline - now_s()) * 1000) + 1;
      if (left < 0) left = 0;
      if (wait_ms < 0 || left < wait_ms) wait_ms = left;
    }
    int ready = poll(p, g.interrupts[0] >= 0 ? 3 : 2, wait_ms);
    if (ready < 0 && errno != EINTR) return NULL;
    if (ready > 0 && p[1].revents) {
      char byte;
      if (read(g.wake[0], &byte, 1) <= 0) return NULL;
      --ready;
    }
    if (ready > 0 && g.interrupts[0] >= 0 && p[2].revents) {
      char bytes[64];
      (void)!read(g.interrupts[0], bytes, sizeof bytes);
      --ready;
      if (deadline == 0) {
        atomic_store(&g.python_ran, 0);
        Py_AddPendingCall(mark_python_ran, NULL);
        deadline = now_s() + g.grace_s;
      }
    }
    if (deadline > 0 && now_s() >= deadline) {
      deadline = 0;
      if (!atomic_load(&g.python_ran)) {
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
    answer_requests();
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
  if (g.read_fd >= 0) Py_RETURN_NONE; /* once a process */
  if (pipe2(g.wake, O_CLOEXEC)) return PyErr_SetFromErrno(PyExc_OSError);
  g.read_fd = read_fd;
  g.rank = rank;
  g.size = size;
  g.main_thread = main_thread;
  snprintf(g.dir, sizeof g.dir, "%s", dir);
  snprintf(g.host, sizeof g.host, "%s", host);
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
    g.read_fd = -1;
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
  int signum, tag_ask, tag_reply;
  double poll_s;
  if (!PyArg_ParseTuple(args, "Liiid", &handle, &signum, &tag_ask, &tag_reply,
                        &poll_s)) {
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  pthread_mutex_lock(&g.mu);
  g.comm = MPI_Comm_f2c((MPI_Fint)handle);
  g.signum = signum;
  g.tag_ask = tag_ask;
  g.tag_reply = tag_reply;
  g.poll_ms = (int)(poll_s * 1000);
  atomic_store(&g.answering, 1);
  pthread_mutex_unlock(&g.mu);
  if (g.read_fd >= 0) write_all(g.wake[1], "", 1); /* poll with the period now */
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *stop_answering(PyObject *self, PyObject *unused) {
  (void)self;
  (void)unused;
  Py_BEGIN_ALLOW_THREADS /* waits for a request being answered */
  pthread_mutex_lock(&g.mu);
  atomic_store(&g.answering, 0);
  pthread_mutex_unlock(&g.mu);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *watch_interrupts(PyObject *self, PyObject *args) {
  (void)self;
  int dump_signum;
  double grace_s;
  if (!PyArg_ParseTuple(args, "id", &dump_signum, &grace_s)) return NULL;
  if (g.read_fd < 0) {
    PyErr_SetString(PyExc_RuntimeError, "_stacks: start() first");
    return NULL;
  }
  if (g.interrupts[0] >= 0) Py_RETURN_NONE; /* once a process */
  if (pipe2(g.interrupts, O_CLOEXEC | O_NONBLOCK)) {
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  g.dump_signum = dump_signum;
  g.grace_s = grace_s;
  struct sigaction ours;
  memset(&ours, 0, sizeof ours);
  ours.sa_sigaction = on_sigint;
  ours.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGINT, &ours, &g.python_sigint)) {
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
  int n = atomic_load(&g.readers);
  for (int i = 0; i < n; ++i) {
    if ((void *)g.in_flight[i] == reader) Py_RETURN_NONE;
  }
  if (n >= (int)(sizeof g.in_flight / sizeof g.in_flight[0])) Py_RETURN_NONE;
  g.in_flight[n] = (size_t(*)(char *, size_t))reader;
  atomic_store(&g.readers, n + 1);
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
     "answer(fortran_comm, signum, tag_ask, tag_reply, poll_s): answer rank 0's "
     "requests for stacks on the communicator, dumping on signum."},
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
