/* Helpers shared by the subcommands of the kvq tool. */
#ifndef KVQ_TOOL_H
#define KVQ_TOOL_H

#include <stddef.h>
#include <stdio.h>

#include "kvq.h"

int kvq_eval_main(int argc, char **argv);
int kvq_bench_main(int argc, char **argv);
int kvq_membw_main(int argc, char **argv);

/* Prints "kvq CMD: message" to stderr and returns -1. */
int kvq_tool_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- options.c: what the subcommands' options share ---- */
/* "reference", "cpu", "cuda", "emu" -> *out; else prints why and returns -1. */
int kvq_tool_backend(const char *cmd, const char *name, kvq_backend_kind *out);
/* KVQ_OK when an engine of that backend can be created here (why: the reason when not). */
kvq_status kvq_tool_probe_backend(kvq_backend_kind kind, char *why, size_t why_size);
/* The cpu backend when it runs here, else the reference, after a note on stderr saying why. */
kvq_backend_kind kvq_tool_default_backend(const char *cmd);
/* "A,B,C": up to max integers in [lo, hi] into out[*n]; prints why and returns -1 when not. */
int kvq_tool_int_list(const char *cmd, const char *opt, const char *s, int lo, int hi, int *out, int max, int *n);
/* s as a JSON string literal, quotes included. */
void kvq_tool_json_string(FILE *f, const char *s);

/* ---- membw.c: the machine, its read bandwidth (docs/bench.md) and the clock every timing reads ---- */
double kvq_tool_now(void); /* monotonic seconds */
typedef struct {
    char model[128];     /* /proc/cpuinfo's model name, or "unknown CPU" */
    int cpus, usable;    /* online CPUs; those this process may run on */
    long long llc_bytes; /* the last-level cache of cpu0 (0: sysfs does not say) */
    int llc_level;
    long long l2_bytes;
} kvq_machine;
void kvq_machine_describe(kvq_machine *m);

typedef struct {
    int threads, passes;
    double gbps, gbps_min, gbps_max; /* median, min, max over the passes */
    double loop_gbps;                /* the same loop over data in L2: what the loop alone can do */
    size_t buffer_bytes;
} kvq_membw_result;

typedef struct kvq_membw kvq_membw; /* the read buffer and the machine it was sized for */
/* bytes 0: 8x the LLC (at least 256 MiB; 1 GiB when the LLC is unknown). NULL with err set on failure. */
kvq_membw *kvq_membw_open(size_t bytes, char *err, size_t errsz);
void kvq_membw_close(kvq_membw *m);
const kvq_machine *kvq_membw_machine(const kvq_membw *m);
/* The read bandwidth with `threads` readers (the caller is the first), each pinned to the i-th CPU of the
 * process's original affinity mask when pin is set. Returns 0, or -1 with err set. */
int kvq_membw_measure(kvq_membw *m, int threads, int pin, int passes, kvq_membw_result *r, char *err, size_t errsz);
/* Reads 4x the LLC (single thread) so that no earlier data stays cached. */
void kvq_membw_evict(kvq_membw *m);
/* Pins the calling thread to the index-th CPU (modulo their count) of the affinity mask the process had before
 * its first call; returns the CPU number, or -1. */
int kvq_pin_to_cpu(int index);
/* Gives the calling thread back that original mask (nothing when it was never pinned); 0, or -1. Threads a
 * pinned thread creates inherit its one CPU: kvq bench unpins around kvq_engine_create, whose cpu backend starts
 * its pool's workers there. */
int kvq_unpin(void);

#endif
