/* The source lines of a dump's frames, for _stacks (stacks.c): `# line PATH:N:
   TEXT` for each place a frame stands at, read from its file at that moment,
   so that --hangs can show them beside the stacks (it reads no file a dump
   names: the dump is all it quotes).

   A frame's file is whatever its code object's co_filename says, and nothing
   makes that a source file: exec(compile(src, "/tmp/fifo", "exec")) names a
   FIFO, whose open() blocks until someone writes, and "/dev/zero" or
   "/proc/self/pagemap" read without end. So a file is read only where stat()
   says it is a regular file (a link to one too: runfiles trees and Nix stores
   are links), and opened with O_NONBLOCK and O_NOCTTY, and fstat() then says it
   is that same regular file; never past the size fstat() gives (0 for /proc's
   files: none of them is read), nor past MAX_SOURCE_BYTES, nor, over the whole
   dump, past MAX_DUMP_SOURCE_BYTES; memory is this thread's stack. A place not
   read for one of those reasons gets `# no line PATH:N: WHY` instead; one whose
   file is missing (`<string>`, `<frozen ...>`) or too short gets no line, as
   before. Plain system calls, no stdio: whoever holds a stdio lock may be the
   thread that is stuck. */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "stacks.h"

/* The places a dump's frames stand at, at most (the ones after are left out). */
enum { MAX_PLACES = 512 };

/* How far into one file a line is looked for: the largest source files, generated
   ones, are a few MiB; what lies further is not a source file's line. */
#define MAX_SOURCE_BYTES (16L << 20)
/* What one dump reads of source files at most: a stack of a hundred frames in
   modules of a few hundred KiB reads a few MiB, from the page cache. */
#define MAX_DUMP_SOURCE_BYTES (64L << 20)

/* Line `line` (from 1) of `path` into `out`, without its surrounding blanks ("":
   none), reading at most `*budget` bytes and taking what it read off it.
   Returns NULL, or why the file was not read (for `# no line`). */
static const char *source_line(const char *path, long line, char *out,
                               size_t capacity, long *budget) {
  out[0] = '\0';
  struct stat named, opened;
  if (line < 1 || stat(path, &named) != 0) return NULL; /* <string> and the like */
  if (S_ISFIFO(named.st_mode)) return "a FIFO, not read";
  if (S_ISCHR(named.st_mode) || S_ISBLK(named.st_mode)) return "a device, not read";
  if (S_ISDIR(named.st_mode)) return "a folder, not read";
  if (!S_ISREG(named.st_mode)) return "not a regular file, not read";
  if (named.st_size == 0) return "of size 0 (as /proc's files say), not read";
  if (*budget <= 0) {
    return "not read: the dump had read its 64 MiB of source files";
  }
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) return NULL;
  if (fstat(fd, &opened) != 0 || !S_ISREG(opened.st_mode) ||
      opened.st_dev != named.st_dev || opened.st_ino != named.st_ino) {
    close(fd);
    return "replaced by another file as it was opened, not read";
  }
  /* The bound that stops the reading first: the file's end, 16 MiB, the dump's. */
  long limit = opened.st_size < MAX_SOURCE_BYTES ? (long)opened.st_size
                                                 : MAX_SOURCE_BYTES;
  if (limit > *budget) limit = *budget;
  const char *cut = limit == opened.st_size ? NULL
                    : limit == *budget
                        ? "not reached within the dump's 64 MiB of source files"
                        : "not within its first 16 MiB, read no further";
  char buffer[16384];
  size_t kept = 0;
  long n = 1, left = limit;
  int done = 0;
  while (!done && left > 0) {
    size_t want = left < (long)sizeof buffer ? (size_t)left : sizeof buffer;
    ssize_t got = read(fd, buffer, want);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    left -= got;
    *budget -= got;
    for (const char *at = buffer, *end = buffer + got; at < end && !done;) {
      const char *newline = memchr(at, '\n', (size_t)(end - at));
      const char *stop = newline ? newline : end;
      if (n == line) {
        size_t piece = (size_t)(stop - at);
        if (piece > capacity - 1 - kept) piece = capacity - 1 - kept;
        memcpy(out + kept, at, piece);
        kept += piece;
        done = newline != NULL;
      }
      if (newline) ++n;
      at = newline ? newline + 1 : end;
    }
  }
  close(fd);
  out[kept] = '\0';
  if (n < line && left == 0 && cut != NULL) return cut;
  char *start = out, *end = out + kept;
  while (*start == ' ' || *start == '\t') ++start;
  while (end > start && (end[-1] == '\r' || end[-1] == ' ' || end[-1] == '\t')) {
    --end;
  }
  memmove(out, start, (size_t)(end - start));
  out[end - start] = '\0';
  return NULL;
}

/* `# line PATH:N: TEXT` for each place a frame of the dump stands at (faulthandler's
   `  File "PATH", line N in FUNCTION`), once per place, or `# no line PATH:N: WHY`
   where source_line would not read the file. */
void add_source_lines(Text *out, const char *dump) {
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
  long budget = MAX_DUMP_SOURCE_BYTES;
  for (int i = 0; i < count; ++i) {
    char path[PATH_MAX], text[1024];
    if (places[i].length >= sizeof path) continue;
    snprintf(path, sizeof path, "%.*s", (int)places[i].length, places[i].path);
    const char *why = source_line(path, places[i].line, text, sizeof text, &budget);
    if (why != NULL) {
      addf(out, "# no line %s:%ld: %s\n", path, places[i].line, why);
    } else if (text[0]) {
      addf(out, "# line %s:%ld: %s\n", path, places[i].line, text);
    }
  }
}

