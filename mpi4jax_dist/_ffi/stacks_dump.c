/* A rank's dump of its stacks, as _stacks (stacks.c) writes it: read whole from
   the pipe faulthandler writes into (or dumped on a signal here and read), the
   package's own threads left out, a header put before it (rank, host, pid, when
   the dump came and when it was written, why) and the source lines of its frames
   after it (stacks_sources.c); written to MPI4JAX_DIST_HANG_DIR/rank-N.txt, or to
   stderr as [rank N] lines. */

#define _GNU_SOURCE /* mkostemp */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "stacks.h"

/* A dump is whole once its pipe has been quiet this long. */
enum { QUIET_MS = 50 };

Dumps dumps = {.read_fd = -1};

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
int read_dump(Text *t) {
  char buffer[65536];
  for (;;) {
    ssize_t n = read(dumps.read_fd, buffer, sizeof buffer);
    if (n > 0) {
      add(t, buffer, (size_t)n);
    } else if (n == 0) {
      return -1;
    } else if (errno != EINTR && errno != EAGAIN) {
      return -1;
    }
    struct pollfd p = {dumps.read_fd, POLLIN, 0};
    int ready = poll(&p, 1, QUIET_MS);
    if (ready == 0) return 0;
    if (ready < 0 && errno != EINTR) return -1;
  }
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
      own = thread != dumps.main_thread &&
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
void write_dump(const char *whole_dump, const char *reason,
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
  addf(&header, "mpi4jax_dist stacks: rank %d of %d\n", dumps.rank, dumps.size);
  addf(&header, "host %s pid %ld signal %s written %s reason %s\n", dumps.host,
       (long)getpid(), came_text, now_text, reason);
  addf(&header, "main thread 0x%016lx\n", dumps.main_thread);
  Text file = {0};
  for (char *line = header.data; line && *line;) {
    char *end = strchr(line, '\n');
    addf(&file, "# %.*s\n", (int)(end - line), line);
    line = end + 1;
  }
  add(&file, dump, strlen(dump));
  if (file.size && file.data[file.size - 1] != '\n') add(&file, "\n", 1);
  Text sources = {0};
  if (dumps.dir[0] || whole != NULL) add_source_lines(&sources, dump);
  snprintf(where, where_capacity, "stderr");
  if (dumps.dir[0]) {
    char path[PATH_MAX + 32], partial[PATH_MAX + 64];
    make_dirs(dumps.dir);
    snprintf(path, sizeof path, "%s/rank-%d.txt", dumps.dir, dumps.rank);
    /* A new file of a name nobody can foresee (mkstemp: O_CREAT | O_EXCL, mode
       0600), never one found there: a link planted in a shared folder under a
       name we would use must not have us truncate its target. rename()
       replaces a link at `path` itself, never what it points to. */
    snprintf(partial, sizeof partial, "%s/.rank-%d.txt.XXXXXX", dumps.dir, dumps.rank);
    int fd = mkostemp(partial, O_CLOEXEC);
    int failed = fd < 0;
    if (!failed) {
      failed = write_all(fd, file.data, file.size) ||
               (sources.size && write_all(fd, sources.data, sources.size));
      failed = close(fd) || failed;
      failed = failed || rename(partial, path);
    }
    if (!failed) {
      snprintf(where, where_capacity, "%s", dumps.dir);
    } else {
      const int error = errno;
      if (fd >= 0) unlink(partial); /* ours: made by mkostemp above */
      fprintf(stderr,
              "[rank %d] mpi4jax_dist: could not write %s (%s): the stacks "
              "follow.\n",
              dumps.rank, path, strerror(error));
    }
  }
  if (!strcmp(where, "stderr")) {
    /* [rank N] before each line; the header's three lines as one. */
    Text out = {0};
    char *first = header.data, *second = strchr(first, '\n') + 1;
    char *third = strchr(second, '\n') + 1;
    addf(&out, "[rank %d] %.*s (%.*s; %.*s):\n", dumps.rank,
         (int)(second - first - 1), first, (int)(third - second - 1), second,
         (int)strcspn(third, "\n"), third);
    for (const char *line = dump; *line;) {
      const char *end = strchr(line, '\n');
      size_t length = end ? (size_t)(end - line) : strlen(line);
      addf(&out, "[rank %d] %.*s\n", dumps.rank, (int)length, line);
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
void dump_on(int signum, Text *dump) {
  if (signum <= 0) return;
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, signum);
  pthread_sigmask(SIG_UNBLOCK, &one, NULL);
  int raised = raise(signum) == 0;
  pthread_sigmask(SIG_BLOCK, &one, NULL);
  if (raised) read_dump(dump);
}

