/* What _stacks (stacks.c) writes with: a growing byte string, and a write of
   all of one to a file descriptor. */

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "stacks.h"

void add(Text *t, const char *s, size_t n) {
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

void addf(Text *t, const char *format, ...) {
  char buffer[PATH_MAX + 2 * REASON_BYTES];
  va_list args;
  va_start(args, format);
  int n = vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  if (n > 0) add(t, buffer, (size_t)n < sizeof buffer ? (size_t)n : sizeof buffer - 1);
}

int write_all(int fd, const char *data, size_t size) {
  while (size > 0) {
    ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return -1;
    data += n;
    size -= (size_t)n;
  }
  return 0;
}

