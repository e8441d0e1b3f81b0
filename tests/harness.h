/* A minimal test harness. Each test program runs its checks and prints one line per test case:
 *   PASS <name>            or   FAIL <name>: <what went wrong>
 * tests/run.sh runs every program and totals the lines into "N passed, N failed". A check that fails prints
 * where it is and keeps the program going to the next case. */
#ifndef KVQ_TEST_HARNESS_H
#define KVQ_TEST_HARNESS_H

#include <stdio.h>

/* Source directory of the project (tests read specs/, tests/lang/...). Set by KVQ_SRCDIR, default ".". */
const char *th_srcdir(void);
/* Builds "<srcdir>/<rel>" in a static rotating buffer. */
const char *th_path(const char *rel);

/* Begin/end a named test case; TH_CHECK inside marks it failed with a message. */
void th_begin(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int th_end(void); /* prints PASS/FAIL, returns 1 if passed */
void th_fail(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int th_failed(void); /* current case failed so far */
int th_summary(void); /* exit status for main(): 0 when nothing failed */
/* The names of the files in <srcdir>/<rel_dir> ending in `suffix`, sorted, malloc'd into names[0..max); returns
 * their count (0 when the folder cannot be read). The caller frees each name. */
int th_list_files(const char *rel_dir, const char *suffix, char **names, int max);
/* Sharding (tests/run.sh, tests/test-times): with KVQ_TEST_SHARD=K/N in the environment a program runs only its
 * units of work K, K + N, K + 2N, ...; each call numbers the next unit and says whether this shard runs it (always
 * 1 without the variable). th_shard_count() is N (1 unsharded). Units are numbered in a fixed order, so the N
 * shards together run every unit once. */
int th_shard_mine(void);
int th_shard_count(void);

#define TH_CHECK(cond, ...)                                                                                    \
    do {                                                                                                       \
        if (!(cond)) th_fail(__FILE__, __LINE__, __VA_ARGS__);                                                 \
    } while (0)

#endif
