/* SIGINT (Ctrl-C) watched by _stacks's thread (stacks.c) once
   watch_interrupts() set it up: a handler in front of Python's writes a byte
   into a pipe and calls Python's. Python raises KeyboardInterrupt only once its
   main thread runs bytecode again, which a rank waiting in C (an MPI
   collective, a jitted program) never does: where it has not run `grace_s`
   seconds after the signal, the thread writes the rank's stacks (as for
   SIGUSR1, stacks_dump.c) and one line, and ends the job with MPI_Abort(130). */

#include <mpi.h>

#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "stacks.h"

Interrupts interrupts = {.pipe = {-1, -1}};

/* SIGINT: a byte for the thread, then Python's handler (async-signal-safe). */
void on_sigint(int signum, siginfo_t *info, void *context) {
  int saved = errno;
  char byte = 'I';
  (void)!write(interrupts.pipe[1], &byte, 1);
  const struct sigaction *py = &interrupts.python_handler;
  if (py->sa_flags & SA_SIGINFO) {
    if (py->sa_sigaction != NULL) py->sa_sigaction(signum, info, context);
  } else if (py->sa_handler != SIG_IGN && py->sa_handler != SIG_DFL) {
    py->sa_handler(signum);
  }
  errno = saved;
}

/* A pending call: the main thread has run bytecode since it was added. */
int mark_python_ran(void *unused) {
  (void)unused;
  atomic_store(&interrupts.python_ran, 1);
  return 0;
}

double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The grace after a SIGINT has passed and Python has not run: the stacks, one
   line, and the end of the job (the thread's mutex held, stacks.c). */
void end_interrupted(void) {
  struct timespec came;
  clock_gettime(CLOCK_REALTIME, &came);
  Text dump = {0};
  dump_on(interrupts.dump_signum, &dump);
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
          dumps.rank, dumps.size, interrupts.grace_s, where[0] ? where : "none");
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

