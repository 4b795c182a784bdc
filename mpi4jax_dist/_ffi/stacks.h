/* The declarations _stacks's sources share (stacks.c, the Python module and its
   thread, over stacks_text.c, stacks_sources.c, stacks_dump.c, stacks_answer.c,
   stacks_status.c and stacks_interrupt.c): what each keeps, and what the
   others call of it.
   Nothing here is exported from the module (it is built with
   -fvisibility=hidden): its one public name is PyInit__stacks. */

#ifndef MPI4JAX_DIST_FFI_STACKS_H_
#define MPI4JAX_DIST_FFI_STACKS_H_

#include <mpi.h>

#include <limits.h>
#include <regex.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* ---- stacks_text.c: what the thread writes with ---- */

/* The longest reason a dump is written for (a request's text, in bytes). */
enum { REASON_BYTES = 1024 };

/* A growing byte string. */
typedef struct {
  char *data;
  size_t size, capacity;
} Text;

/* Append `n` bytes of `s` (the text loses them where memory runs out), or
   printf's output; the text stays NUL ended. */
void add(Text *t, const char *s, size_t n);
void addf(Text *t, const char *format, ...)
    __attribute__((format(printf, 2, 3)));
/* Write all of `data` to `fd`; 0, or -1 on an error. */
int write_all(int fd, const char *data, size_t size);

/* ---- stacks_sources.c ---- */

/* `# line PATH:N: TEXT` for each place a frame of `dump` stands at, read from
   its file now, or `# no line PATH:N: WHY` where the file is not read. */
void add_source_lines(Text *out, const char *dump);

/* ---- stacks_dump.c: a rank's dump of its stacks ---- */

/* Where the dumps come from and go, as start() set it. */
typedef struct {
  int read_fd; /* the pipe faulthandler writes into (-1: not started) */
  int rank, size;
  char dir[PATH_MAX]; /* "": stderr */
  char host[256];
  unsigned long main_thread;
} Dumps;
extern Dumps dumps;

/* Read one dump from the pipe until it is quiet; -1 when the pipe is closed or
   broken. */
int read_dump(Text *t);
/* Write a dump, which came at `came`, with its header and without the
   package's own threads, into the hang directory or on stderr. `whole`
   receives the header and the dump (NULL: not wanted); `where` the directory
   or "stderr". */
void write_dump(const char *whole_dump, const char *reason,
                const struct timespec *came, Text *whole, char *where,
                size_t where_capacity);
/* Raise `signum` (0: none) on this thread, so that faulthandler dumps into the
   pipe, and read the dump into `dump`. */
void dump_on(int signum, Text *dump);

/* ---- stacks_answer.c: the reporter's requests for the stacks ---- */

typedef struct {
  /* answer(): the watchdog's communicator, the signal faulthandler dumps on,
     the tags and the period of the look for requests. */
  atomic_int on;
  MPI_Comm comm;
  int signum, tag_ask, tag_reply, poll_ms;
  /* set_in_flight(): the readers of the calls the rank is in (the
     extensions' Record::InFlightText, the MPI wrapper's record of XLA's
     calls), quoted in a reply for a rank whose Python cannot answer. */
  size_t (*in_flight[4])(char *out, size_t capacity);
  atomic_int readers;
} Answers;
extern Answers answers;

/* Answer the requests that have come (the thread's mutex held, stacks.c). */
void answer_requests(void);
/* One look for a request of `tag` on the watchdog's communicator (a few
   MPI_Improbe calls): 1 and the message matched, or 0. */
int find_request(int tag, MPI_Message *message, MPI_Status *status);
/* Send the first `count` bytes of `reply` to `dest` on the watchdog's
   communicator without spinning: 1 once received; 0 where the asker has not
   received it in 10 s (the buffer is then MPI's: `reply` is emptied, not
   freed). */
int send_patiently(Text *reply, int count, int dest, int tag);
/* The calls the records say the rank is in, one line ("" for none). */
void quote_in_flight(char *calls, size_t capacity);

/* ---- stacks_status.c: `python -m mpi4jax_dist status` answered ---- */

typedef struct {
  /* listen_status(): the rank's Unix socket (-1: none), its path, the job as
     the replies name it, the signal faulthandler dumps on, for the main
     thread's line (0: none), and the paths of library code, which that line
     looks past (faulthandler's frames, as the hang reports do). */
  int listen_fd;
  char path[108];
  char job[256];
  int signum;
  regex_t library;
  int library_set;
  /* answer(): the tags of the ranks' requests for their lines and of the
     replies, on the watchdog's communicator (answers.comm; 0: none). */
  int tag_ask, tag_reply;
  /* set_totals(): the record's calls entered, ns blocked and first entry
     (record.h's mpi4jax_dist_totals; NULL: no record loaded yet). */
  void (*totals)(int64_t out[3]);
} Status;
extern Status status;

/* A client waits on the socket: answer it (the thread's mutex held). */
void answer_status_client(void);
/* Other ranks' requests for this rank's line, answered (the mutex held). */
void answer_status_asks(void);

/* ---- stacks_interrupt.c: SIGINT watched ---- */

/* watch_interrupts(): the pipe the SIGINT handler writes into (-1: none),
   Python's handler, the signal faulthandler dumps on, the grace, and whether
   Python has run since the last SIGINT (a pending call sets it). */
typedef struct {
  int pipe[2];
  struct sigaction python_handler;
  int dump_signum;
  double grace_s;
  atomic_int python_ran;
} Interrupts;
extern Interrupts interrupts;

/* The SIGINT handler in front of Python's; a pending call that marks Python
   run; the monotonic clock in seconds; and the end of the job once the grace
   has passed without Python (the thread's mutex held). */
void on_sigint(int signum, siginfo_t *info, void *context);
int mark_python_ran(void *unused);
double now_s(void);
void end_interrupted(void);

#endif /* MPI4JAX_DIST_FFI_STACKS_H_ */
