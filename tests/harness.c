#include "harness.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static char case_name[512];
static int case_failed, n_pass, n_fail;

const char *th_srcdir(void)
{
    const char *d = getenv("KVQ_SRCDIR");
    return d && *d ? d : ".";
}

const char *th_path(const char *rel)
{
    static char bufs[4][4096];
    static int k;
    char *b = bufs[k++ & 3];
    snprintf(b, sizeof bufs[0], "%s/%s", th_srcdir(), rel);
    return b;
}

void th_begin(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(case_name, sizeof case_name, fmt, ap);
    va_end(ap);
    case_failed = 0;
}

void th_fail(const char *file, int line, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    /* Only the first failure of a case goes on the FAIL line; the rest are context. */
    if (!case_failed)
        printf("FAIL %s: %s:%d: %s\n", case_name, file, line, msg);
    else
        printf("  also: %s:%d: %s\n", file, line, msg);
    case_failed = 1;
}

int th_failed(void) { return case_failed; }

int th_end(void)
{
    if (case_failed) {
        n_fail++;
    } else {
        n_pass++;
        printf("PASS %s\n", case_name);
    }
    fflush(stdout);
    return !case_failed;
}

int th_summary(void) { return n_fail ? 1 : 0; }

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int th_list_files(const char *rel_dir, const char *suffix, char **names, int max)
{
    DIR *dir = opendir(th_path(rel_dir));
    size_t sl = strlen(suffix);
    int n = 0;
    for (struct dirent *de; dir && (de = readdir(dir)) && n < max;) {
        size_t len = strlen(de->d_name);
        if (len > sl && !strcmp(de->d_name + len - sl, suffix) && (names[n] = strdup(de->d_name))) n++;
    }
    if (dir) closedir(dir);
    qsort(names, (size_t)n, sizeof *names, by_name);
    return n;
}

/* KVQ_TEST_SHARD=K/N, read once; N = 1 when unset or malformed. */
static int shard_k, shard_n, shard_next;

static void shard_read(void)
{
    if (shard_n) return;
    const char *e = getenv("KVQ_TEST_SHARD");
    int k = 0, n = 1;
    if (e && sscanf(e, "%d/%d", &k, &n) == 2 && n >= 1 && k >= 0 && k < n) shard_k = k, shard_n = n;
    else shard_k = 0, shard_n = 1;
}

int th_shard_mine(void)
{
    shard_read();
    return shard_next++ % shard_n == shard_k;
}

int th_shard_count(void)
{
    shard_read();
    return shard_n;
}
