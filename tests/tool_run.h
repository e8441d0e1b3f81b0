/* Running a built tool (kvq, kvqc) as a user does, for the tests that check the tools end to end: the binary
 * with its arguments from the source directory, stdout and stderr captured in files of a scratch directory. */
#ifndef KVQ_TEST_TOOL_RUN_H
#define KVQ_TEST_TOOL_RUN_H

#include <stddef.h>

typedef struct {
    int status;      /* exit status, or -signal when killed (-1000: it could not be started) */
    char *out, *err; /* what it printed (first 64 KiB of each) */
    double seconds;  /* wall time */
    long max_rss_kb; /* the child's peak resident memory */
} th_run_result;

/* Runs `tool` with args (NULL-terminated) in th_srcdir(); `scratch` holds the captured output. A tool still
 * running after `timeout_s` seconds is killed by SIGALRM (the case fails instead of hanging); 0 = no limit. */
/* The tool `name` built next to the running test (BUILD/tests/test_x -> BUILD/name) into out; 0 when it is an
 * executable, -1 when not. */
int th_tool_path(const char *name, char *out, size_t size);
th_run_result th_run(const char *tool, const char *scratch, const char *const *args, unsigned timeout_s);
void th_run_free(th_run_result *r);
/* No sanitizer report, no crash: the tool ended by exit() with a status of its own (0, 1 or 2). */
void th_run_check_clean(const th_run_result *r);

#endif
