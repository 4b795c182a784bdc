/* The reporter's requests for a rank's stacks, answered by _stacks's thread
   (stacks.c) where the rank's Python cannot answer them: answer() sets them up.

The reporting rank (rank 0, or its deputy where rank 0's watchdog cannot run)
asks on the watchdog's communicator (tag `ask`, the dump's reason as text);
each request raises the signal faulthandler dumps on, and the dump, written as
the thread writes every dump (stacks_dump.c), goes back to the asker (tag
`reply`: where it was written, a newline, the calls the extensions' records say
the rank is in, a newline, the dump). The thread looks for requests every
`poll_ms` milliseconds (MPI_Improbe, a local call) and never else. */

#include <mpi.h>

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "stacks.h"

/* The MPI calls a look for requests makes. */
enum { PROBES = 4 };

Answers answers;

int find_request(int tag, MPI_Message *message, MPI_Status *status) {
  int found = 0;
  /* A message that has come may take more than one call's progress to be
     matched (MPICH 5's shared memory): a few calls a look. */
  for (int tries = 0; tries < PROBES && !found; ++tries) {
    if (MPI_Improbe(MPI_ANY_SOURCE, tag, answers.comm, &found, message,
                    status) != MPI_SUCCESS) {
      return 0;
    }
  }
  return found;
}

/* How long a reply's send waits for the asker to receive it: the asker's
   own wait (faults/report.py's REPLY_S). */
enum { SEND_WAIT_MS = 10000 };

int send_patiently(Text *reply, int count, int dest, int tag) {
  MPI_Request request;
  if (MPI_Isend(reply->data, count, MPI_CHAR, dest, tag, answers.comm,
                &request) != MPI_SUCCESS) {
    return 0;
  }
  /* MPI_Send would spin (with MPICH, yielding) until the asker receives: a
     rank pinned to the asker's core then kept the asker from running at all,
     for a minute. Tested once a millisecond instead. */
  for (int waited_ms = 0; waited_ms < SEND_WAIT_MS; ++waited_ms) {
    int done = 0;
    if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) break;
    if (done) return 1;
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
  }
  /* Not received: MPI keeps the buffer until the send completes, if ever. */
  MPI_Request_free(&request);
  *reply = (Text){0};
  return 0;
}

void quote_in_flight(char *calls, size_t capacity) {
  size_t used = 0;
  calls[0] = '\0';
  for (int i = 0; i < atomic_load(&answers.readers); ++i) {
    char one[1024];
    if (answers.in_flight[i](one, sizeof one) == 0) continue;
    int n = snprintf(calls + used, capacity - used, "%s%s",
                     used ? "; " : "", one);
    if (n < 0) break;
    used += (size_t)n;
    if (used >= capacity) {
      used = capacity - 1;
      break;
    }
  }
  for (char *c = calls; *c; ++c) {
    if (*c == '\n') *c = ' ';
  }
}

/* The reporter's requests (rank 0's, or its deputy's), answered (with the
   thread's mutex held, stacks.c): a dump on the signal, written, and sent back
   to the asker. */
void answer_requests(void) {
  while (atomic_load(&answers.on)) {
    MPI_Message message;
    MPI_Status status;
    if (!find_request(answers.tag_ask, &message, &status)) return;
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
    dump_on(answers.signum, &dump);
    if (dump.size == 0) {
      static const char kNone[] =
          "(no stacks: faulthandler is not registered on a signal here)\n";
      add(&dump, kNone, sizeof kNone - 1);
    }
    char where[PATH_MAX];
    write_dump(dump.data, reason, &came, &whole, where, sizeof where);
    Text reply = {0};
    addf(&reply, "%s\n", where);
    char calls[2048];
    quote_in_flight(calls, sizeof calls);
    addf(&reply, "%s\n", calls);
    add(&reply, whole.data, whole.size);
    send_patiently(&reply, (int)reply.size, status.MPI_SOURCE,
                   answers.tag_reply);
    free(dump.data);
    free(whole.data);
    free(reply.data);
  }
}

