/* `python -m mpi4jax_dist status`: a running job's ranks say where they stand,
   answered by _stacks's thread (stacks.c) without Python, so that a rank whose
   Python cannot run answers as well as one whose can.

Each rank listens on a Unix socket of its own (listen_status(), from
mpi4jax_dist.faults.status, in MPI4JAX_DIST_STATUS_DIR). The thread waits in
poll() with the socket among its descriptors and wakes only when a client
connects: nothing is paid until then. The client writes one line: "local" has
the rank answer for itself; "job" has it also send every other rank of the
watchdog's communicator a request (tag `ask`: the request's number, 8 bytes),
which their threads answer at their next look for requests (every poll_ms,
beside the watchdog's own: stacks_answer.c), and gather the replies until
every rank has answered or one look and two seconds have passed. Then it
writes them all to the client:

  mpi4jax_dist status 1\tJOB\tSIZE\tRANK ASKED\n
  one line a rank that answered (status_line)
  end\tANSWERED\tNS TAKEN\tTHIS RANK'S CALLS AT THE END\n

Flat, as the hang reports ask: the asked rank sends P-1 requests of 8 bytes and
receives at most P-1 lines of at most LINE_BYTES. */

#define _GNU_SOURCE /* accept4 */
#include <mpi.h>

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <regex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "stacks.h"

/* The longest line a rank sends (its calls' text cut to fit). */
enum { LINE_BYTES = 1536 };

Status status = {.listen_fd = -1};

static int64_t clock_ns(clockid_t id) {
  struct timespec t;
  clock_gettime(id, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A frame of a library (the standard library, installed packages, JAX, this
   package) rather than of the program: its path, `length` bytes, matches the
   hang reports' pattern (faults/stacks.py's LIBRARY_PATTERN, compiled by
   listen_status). */
static int library_frame(const char *path, size_t length) {
  if (!status.library_set) return 0;
  char copy[PATH_MAX];
  snprintf(copy, sizeof copy, "%.*s", (int)length, path);
  return regexec(&status.library, copy, 0, NULL, 0) == 0;
}

/* Where the main thread stands in `dump` (faulthandler's): its innermost
   frame of the program's own ("step.py:40 in body", the file's name without
   its folder), or of a library where none is the program's; "" where the dump
   has no block of the main thread. */
static void python_line(const char *dump, char *out, size_t capacity) {
  out[0] = '\0';
  char id[64];
  snprintf(id, sizeof id, "hread 0x%016lx", dumps.main_thread);
  const char *block = strstr(dump, id);
  if (block == NULL) return;
  const char *end = strstr(block, "\n\n");
  int found_own = 0;
  for (const char *line = strchr(block, '\n'); line && (!end || line < end);
       line = strchr(line + 1, '\n')) {
    const char *file = line + 1;
    if (strncmp(file, "  File \"", 8) != 0) continue;
    file += 8;
    const char *quote = strchr(file, '"');
    const char *eol = strchr(file, '\n');
    if (quote == NULL || (eol != NULL && quote > eol)) continue;
    int library = library_frame(file, (size_t)(quote - file));
    if (found_own || (library && out[0] != '\0')) continue;
    const char *name = file;
    for (const char *c = file; c < quote; ++c) {
      if (*c == '/') name = c + 1;
    }
    long number = 0;
    char function[256] = "?";
    sscanf(quote, "\", line %ld in %255[^\n]", &number, function);
    snprintf(out, capacity, "%.*s:%ld in %s", (int)(quote - name), name, number,
             function);
    found_own = !library;
  }
}

/* Cut tabs and newlines out of a field. */
static void one_field(char *text) {
  for (char *c = text; *c; ++c) {
    if (*c == '\t' || *c == '\n') *c = ' ';
  }
}

/* This rank's line: rank, host, pid, calls entered, ns blocked in them, ns
   since the first was entered, the wall clock (ns), the calls it is in ("" for
   none) and its main thread's Python line ("" where unknown), tab separated. */
static void status_line(Text *out) {
  int64_t totals[3] = {0, 0, 0};
  if (status.totals != NULL) status.totals(totals);
  const int64_t now = clock_ns(CLOCK_MONOTONIC);
  char calls[1024];
  quote_in_flight(calls, sizeof calls);
  one_field(calls);
  char line[512] = "";
  Text dump = {0};
  dump_on(status.signum, &dump);
  if (dump.size) python_line(dump.data, line, sizeof line);
  free(dump.data);
  one_field(line);
  addf(out, "%d\t%s\t%ld\t%lld\t%lld\t%lld\t%lld\t%s\t%s\n", dumps.rank,
       dumps.host, (long)getpid(), (long long)totals[0],
       (long long)totals[1],
       (long long)(totals[2] ? now - totals[2] : 0),
       (long long)clock_ns(CLOCK_REALTIME), calls, line);
}

/* Other ranks' requests (tag_ask, a request's number) answered with this
   rank's line, after the number. */
void answer_status_asks(void) {
  if (!atomic_load(&answers.on) || status.tag_ask == 0) return;
  for (;;) {
    MPI_Message message;
    MPI_Status got;
    if (!find_request(status.tag_ask, &message, &got)) return;
    int64_t number = 0;
    MPI_Mrecv(&number, 8, MPI_BYTE, &message, MPI_STATUS_IGNORE);
    Text reply = {0};
    add(&reply, (const char *)&number, sizeof number);
    status_line(&reply);
    int size = reply.size < LINE_BYTES + 8 ? (int)reply.size : LINE_BYTES + 8;
    send_patiently(&reply, size, got.MPI_SOURCE, status.tag_reply);
    free(reply.data);
  }
}

/* Every other rank asked for its line (flat: P-1 requests of 8 bytes) and
   the replies of this request gathered into `out`, until all have answered or
   the wait is over; return how many answered. */
static int gather(Text *out) {
  static int64_t number = 0; /* this rank's requests, numbered */
  static int64_t asked;      /* the buffer of the sends below */
  asked = ++number;
  int size = 1;
  MPI_Comm_size(answers.comm, &size);
  for (int r = 0; r < size; ++r) {
    if (r == dumps.rank) continue;
    MPI_Request request;
    if (MPI_Isend(&asked, 8, MPI_BYTE, r, status.tag_ask, answers.comm,
                  &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
  const int64_t deadline =
      clock_ns(CLOCK_MONOTONIC) + (int64_t)(answers.poll_ms + 2000) * 1000000;
  int answered = 0;
  char *line = malloc(LINE_BYTES + 8);
  if (line == NULL) return 0;
  while (answered < size - 1 && clock_ns(CLOCK_MONOTONIC) < deadline) {
    int found = 0;
    MPI_Message message;
    MPI_Status got;
    if (MPI_Improbe(MPI_ANY_SOURCE, status.tag_reply, answers.comm, &found,
                    &message, &got) != MPI_SUCCESS) {
      break;
    }
    if (!found) {
      struct timespec pause = {0, 1000000};
      nanosleep(&pause, NULL);
      continue;
    }
    int count = 0;
    MPI_Get_count(&got, MPI_CHAR, &count);
    if (count > LINE_BYTES + 8) count = LINE_BYTES + 8;
    MPI_Mrecv(line, count, MPI_CHAR, &message, MPI_STATUS_IGNORE);
    int64_t replied = 0;
    if (count > 8) memcpy(&replied, line, 8);
    if (replied != asked) continue; /* a late reply to an earlier request */
    add(out, line + 8, (size_t)(count - 8));
    if (line[count - 1] != '\n') add(out, "\n", 1);
    ++answered;
  }
  free(line);
  return answered;
}

/* Write all of `data` to the client, giving up after the socket's timeout. */
static void send_all(int fd, const char *data, size_t size) {
  while (size > 0) {
    ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    data += n;
    size -= (size_t)n;
  }
}

void answer_status_client(void) {
  int fd = accept4(status.listen_fd, NULL, NULL, SOCK_CLOEXEC);
  if (fd < 0) return;
  struct timeval limit = {2, 0}; /* a client that stops writing or reading */
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
  char request[64];
  size_t got = 0;
  while (got < sizeof request - 1 && memchr(request, '\n', got) == NULL) {
    ssize_t n = recv(fd, request + got, sizeof request - 1 - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += (size_t)n;
  }
  request[got] = '\0';
  if (memchr(request, '\n', got) == NULL) { /* a probe (find_jobs), or cut */
    close(fd);
    return;
  }
  const int64_t start = clock_ns(CLOCK_MONOTONIC);
  int size = dumps.size, job = strncmp(request, "job\n", 4) == 0;
  Text reply = {0};
  addf(&reply, "mpi4jax_dist status 1\t%s\t%d\t%d\n", status.job, size,
       dumps.rank);
  status_line(&reply);
  int answered = 1;
  if (job && size > 1 && atomic_load(&answers.on)) answered += gather(&reply);
  /* This rank's calls once more: where they moved while the others were
     asked, the ranks' counts were read at different points of the work. */
  int64_t totals[3] = {0, 0, 0};
  if (status.totals != NULL) status.totals(totals);
  addf(&reply, "end\t%d\t%lld\t%lld\n", answered,
       (long long)(clock_ns(CLOCK_MONOTONIC) - start), (long long)totals[0]);
  send_all(fd, reply.data, reply.size);
  free(reply.data);
  close(fd);
}
