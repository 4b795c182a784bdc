/* The source lines of a dump's frames, for _stacks (stacks.c): `# line PATH:N:
   TEXT` for each place a frame stands at, read from its file at that moment,
   so that --hangs can show them beside the stacks. */

#ifndef MPI4JAX_DIST_FFI_STACKS_SOURCES_H_
#define MPI4JAX_DIST_FFI_STACKS_SOURCES_H_

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "stacks_text.h"

/* The places a dump's frames stand at, at most (the ones after are left out). */
enum { MAX_PLACES = 512 };

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

#endif /* MPI4JAX_DIST_FFI_STACKS_SOURCES_H_ */
