/* A plain-C driver for the fuzz targets, for machines without clang's libFuzzer and for the smoke run of
 * `make test`: replays every file of tests/fuzz/corpus/<target>/, then mutates them (bit flips, byte changes,
 * insertions of tests/fuzz/<target>.dict tokens, deletions, duplications, splices) for a few seconds
 * ($KVQ_FUZZ_SECONDS, default 3; deterministic from $KVQ_FUZZ_SEED). Prints one PASS line per phase; an
 * invariant failure aborts: the input being run is always kept in /tmp/kvq_fuzz_<target>_<pid>.input, and the
 * abort prints a FAIL line naming it.
 *   build/tests/test_fuzz_spec [FILE...]     replay only the given files (a crash found by libFuzzer) */
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fuzz.h"
#include "harness.h"

#define FUZZ_MAX_INPUT 8192
#define MAX_CORPUS 512
#define MAX_DICT 256

typedef struct {
    unsigned char *data;
    size_t size;
} blob;

static blob corpus[MAX_CORPUS], dict[MAX_DICT];
static int n_corpus, n_dict;
static char keep_path[128];

static void on_abort(int sig)
{
    (void)sig;
    static const char a[] = "FAIL fuzz: an invariant failed or the target crashed; the input is in ";
    if (write(1, a, sizeof a - 1) < 0 || write(1, keep_path, strlen(keep_path)) < 0 || write(1, "\n", 1) < 0) _exit(1);
    _exit(1);
}

static int read_blob(const char *path, blob *b)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    b->data = malloc(FUZZ_MAX_INPUT);
    b->size = b->data ? fread(b->data, 1, FUZZ_MAX_INPUT, f) : 0;
    fclose(f);
    return b->data ? 0 : -1;
}

/* Runs one input, keeping a copy on disk first so a crash can be reproduced. */
static void run_one(const unsigned char *d, size_t n)
{
    FILE *f = fopen(keep_path, "wb");
    if (f) {
        if (fwrite(d, 1, n, f) != n) fputs("", f);
        fclose(f);
    }
    /* a private copy: the target must not rely on bytes past the end */
    unsigned char *copy = malloc(n ? n : 1);
    if (!copy) return;
    memcpy(copy, d, n);
    LLVMFuzzerTestOneInput(copy, n);
    free(copy);
}

static int load_corpus(const char *dir)
{
    DIR *dp = opendir(dir);
    if (!dp) return -1;
    struct dirent *de;
    char path[4096];
    while ((de = readdir(dp)) && n_corpus < MAX_CORPUS) {
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat st;
        if (stat(path, &st) || !S_ISREG(st.st_mode)) continue;
        if (!read_blob(path, &corpus[n_corpus])) n_corpus++;
    }
    closedir(dp);
    return 0;
}

/* libFuzzer's dictionary format: one "token" per line (name= prefixes and # comments allowed), with \\, \" and
 * \xNN escapes. */
static void load_dict(const char *path)
{
    FILE *f = fopen(path, "r");
    char line[512];
    while (f && fgets(line, sizeof line, f) && n_dict < MAX_DICT) {
        char *q = strchr(line, '"');
        if (line[0] == '#' || !q) continue;
        unsigned char tok[256];
        size_t n = 0;
        for (char *p = q + 1; *p && *p != '"' && n < sizeof tok; p++) {
            if (*p == '\\' && p[1] == 'x' && p[2] && p[3]) {
                char hex[3] = {p[2], p[3], 0};
                tok[n++] = (unsigned char)strtol(hex, NULL, 16);
                p += 3;
            } else if (*p == '\\' && p[1]) {
                tok[n++] = (unsigned char)*++p;
            } else {
                tok[n++] = (unsigned char)*p;
            }
        }
        dict[n_dict].data = malloc(n ? n : 1);
        if (!dict[n_dict].data) break;
        memcpy(dict[n_dict].data, tok, n);
        dict[n_dict++].size = n;
    }
    if (f) fclose(f);
}

static uint64_t rng;
static uint64_t next(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return rng;
}

/* One to four mutations of a corpus entry into buf; returns the size. */
static size_t mutate(unsigned char *buf)
{
    const blob *src = &corpus[next() % (uint64_t)n_corpus];
    size_t n = src->size;
    memcpy(buf, src->data, n);
    int rounds = 1 + (int)(next() % 4);
    for (int r = 0; r < rounds; r++) {
        size_t at = n ? (size_t)(next() % n) : 0;
        switch (next() % 7) {
        case 0: /* flip a bit */
            if (n) buf[at] ^= (unsigned char)(1u << (next() % 8));
            break;
        case 1: /* set a byte, often to an edge value */
            if (n) {
                static const unsigned char edge[] = {0, 0xff, 0x7f, 0x80, '0', '9', ';', '{', '}', ' ', '\n'};
                buf[at] = next() & 1 ? edge[next() % sizeof edge] : (unsigned char)next();
            }
            break;
        case 2: /* insert a dictionary token */
            if (n_dict) {
                const blob *t = &dict[next() % (uint64_t)n_dict];
                if (n + t->size <= FUZZ_MAX_INPUT) {
                    memmove(buf + at + t->size, buf + at, n - at);
                    memcpy(buf + at, t->data, t->size);
                    n += t->size;
                }
            }
            break;
        case 3: { /* delete a range */
            size_t len = n - at ? 1 + (size_t)(next() % (n - at)) % 16 : 0;
            memmove(buf + at, buf + at + len, n - at - len);
            n -= len;
            break;
        }
        case 4: { /* duplicate a range */
            size_t len = n - at ? 1 + (size_t)(next() % (n - at)) % 32 : 0;
            if (n + len <= FUZZ_MAX_INPUT) {
                memmove(buf + at + len, buf + at, n - at);
                n += len;
            }
            break;
        }
        case 5: /* truncate */
            n = at;
            break;
        default: { /* splice: the tail of another entry */
            const blob *o = &corpus[next() % (uint64_t)n_corpus];
            size_t from = o->size ? (size_t)(next() % o->size) : 0, len = o->size - from;
            if (at + len > FUZZ_MAX_INPUT) len = FUZZ_MAX_INPUT - at;
            memcpy(buf + at, o->data + from, len);
            n = at + len;
        }
        }
    }
    return n;
}

int main(int argc, char **argv)
{
    snprintf(keep_path, sizeof keep_path, "/tmp/kvq_fuzz_%s_%d.input", fuzz_target_name, (int)getpid());
    signal(SIGABRT, on_abort);
    signal(SIGSEGV, on_abort);
    if (argc > 1) { /* reproduce given inputs */
        th_begin("fuzz %s: replay %d given input(s)", fuzz_target_name, argc - 1);
        for (int i = 1; i < argc; i++) {
            blob b;
            TH_CHECK(read_blob(argv[i], &b) == 0, "cannot read %s", argv[i]);
            if (b.data) run_one(b.data, b.size);
            free(b.data);
        }
        th_end();
        unlink(keep_path);
        return th_summary();
    }
    char rel[256];
    snprintf(rel, sizeof rel, "tests/fuzz/corpus/%s", fuzz_target_name);
    th_begin("fuzz %s: replay the seed corpus %s", fuzz_target_name, rel);
    int loaded = load_corpus(th_path(rel)) == 0 && n_corpus > 0;
    TH_CHECK(loaded, "no seed corpus in %s", th_path(rel));
    snprintf(rel, sizeof rel, "tests/fuzz/%s.dict", fuzz_target_name);
    load_dict(th_path(rel));
    for (int i = 0; i < n_corpus; i++) run_one(corpus[i].data, corpus[i].size);
    printf("  %d corpus inputs, %d dictionary tokens\n", n_corpus, n_dict);
    th_end();
    if (loaded) {
        const char *s = getenv("KVQ_FUZZ_SECONDS"), *seed = getenv("KVQ_FUZZ_SEED");
        double seconds = s ? atof(s) : 3.0;
        rng = seed ? strtoull(seed, NULL, 10) | 1 : 0x2545f4914f6cdd1dull;
        th_begin("fuzz %s: mutate the corpus for %.0f s", fuzz_target_name, seconds);
        static unsigned char buf[FUZZ_MAX_INPUT];
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        long runs = 0;
        do {
            run_one(buf, mutate(buf));
            runs++;
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) * 1e-9 < seconds);
        printf("  %ld mutated inputs\n", runs);
        th_end();
    }
    for (int i = 0; i < n_corpus; i++) free(corpus[i].data);
    for (int i = 0; i < n_dict; i++) free(dict[i].data);
    unlink(keep_path);
    return th_summary();
}
