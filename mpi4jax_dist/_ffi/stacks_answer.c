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
    MPI_Send(reply.data, (int)reply.size, MPI_CHAR, status.MPI_SOURCE,
             answers.tag_reply, answers.comm);
    free(dump.data);
    free(whole.data);
    free(reply.data);
  }
}

