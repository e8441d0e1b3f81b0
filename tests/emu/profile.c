/* Warp-level execution profile of emulated kernels, for kvqc build's cost model (docs/cuda.md, "Cost model").
 *
 * The kernel translation unit is compiled with -finstrument-functions (every call: enter/exit, kept here as a
 * shadow call stack per GPU thread) and -fsanitize-coverage=trace-pc (every basic block calls
 * __sanitizer_cov_trace_pc). A block's key is its address plus the call sites on the thread's stack, so the same
 * source line reached through different calls (the GPU compiler inlines every call) is counted apart.
 *
 * A warp issues an instruction once for all its active lanes: after each thread block, a key's count for a warp
 * is the largest count of its lanes (exact for code the lanes run in step and for code only some lanes run; a
 * lower bound where lanes take a branch at different iterations). The totals over warps and blocks are written
 * to $KVQ_EMU_PROFILE when the module is unloaded: a header line with the module's path, then one line per key:
 * warp count, depth, then the offsets in the module of the block and of each call site, innermost first.
 * Inert (never called) in a module compiled without the two instrumentation flags. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emu_abi.h"
#include "emu_internal.h"

#define NO_INSTR __attribute__((no_instrument_function))
/* glibc defines the two __cyg_ hooks (empty): protected, so the module's calls bind to these */
#define HOOK NO_INSTR __attribute__((visibility("protected")))
#define PROF_DEPTH 24
#define PROF_THREADS 1024

typedef struct {
    uintptr_t pc[PROF_DEPTH + 1]; /* the block, then the call sites, innermost first */
    int depth;                    /* entries of pc used */
    uint64_t warp_count;
} prof_key;

static struct {
    int on, failed;
    uintptr_t stack[PROF_THREADS][PROF_DEPTH];
    int sp[PROF_THREADS];
    prof_key *keys;
    uint32_t n_keys, cap_keys;
    uint32_t *index; /* open addressing: key id + 1, 0 empty; 2 x cap_keys slots */
    uint32_t *lane;  /* [PROF_THREADS][cap_keys]: this block's per-thread counts */
    uint32_t *touched; /* the keys this block counted (block_end folds only these: a launch of many small
                        * blocks would otherwise cost keys x threads a block) */
    unsigned char *is_touched;
    uint32_t n_touched;
    /* the thread's last block: a function's first block is reported before its enter hook runs, so the enter
     * hook moves that count to the key with the new call site */
    uint32_t last_id[PROF_THREADS];
    uintptr_t last_pc[PROF_THREADS];
    unsigned max_thread;
} P;

NO_INSTR static uint64_t hash_chain(const uintptr_t *pc, int depth)
{
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < depth; i++) h = (h ^ (uint64_t)pc[i]) * 1099511628211ull;
    return h ^ h >> 29;
}

NO_INSTR static int grow(void)
{
    uint32_t cap = P.cap_keys ? 2 * P.cap_keys : 4096;
    prof_key *k = realloc(P.keys, (size_t)cap * sizeof *k);
    uint32_t *lane = calloc((size_t)PROF_THREADS * cap, sizeof *lane), *index = calloc(2 * (size_t)cap, sizeof *index);
    if (!k || !lane || !index) {
        free(lane);
        free(index);
        if (k) P.keys = k;
        return -1;
    }
    P.keys = k;
    uint32_t *touched = realloc(P.touched, (size_t)cap * sizeof *touched);
    unsigned char *is_touched = realloc(P.is_touched, cap);
    if (!touched || !is_touched) {
        if (touched) P.touched = touched;
        if (is_touched) P.is_touched = is_touched;
        free(lane);
        free(index);
        return -1;
    }
    memset(is_touched + P.cap_keys, 0, cap - P.cap_keys);
    P.touched = touched, P.is_touched = is_touched;
    for (unsigned t = 0; t < PROF_THREADS && P.lane; t++)
        memcpy(lane + (size_t)t * cap, P.lane + (size_t)t * P.cap_keys, P.cap_keys * sizeof *lane);
    free(P.lane);
    P.lane = lane;
    for (uint32_t i = 0; i < P.n_keys; i++) {
        uint64_t s = hash_chain(P.keys[i].pc, P.keys[i].depth) & (2 * cap - 1);
        while (index[s]) s = (s + 1) & (2 * cap - 1);
        index[s] = i + 1;
    }
    free(P.index);
    P.index = index;
    P.cap_keys = cap;
    return 0;
}

/* After each thread block: a warp's count of a key is the largest of its lanes' */
NO_INSTR static void block_end(unsigned n)
{
    if (n > PROF_THREADS) n = PROF_THREADS;
    for (uint32_t i = 0; i < P.n_touched; i++) {
        const uint32_t k = P.touched[i];
        P.is_touched[k] = 0;
        for (unsigned w = 0; w * 32 < n; w++) {
            uint32_t mx = 0;
            for (unsigned l = w * 32; l < n && l < w * 32 + 32; l++) {
                uint32_t *c = &P.lane[(size_t)l * P.cap_keys + k];
                if (*c > mx) mx = *c;
                *c = 0;
            }
            P.keys[k].warp_count += mx;
        }
    }
    P.n_touched = 0;
    for (unsigned i = 0; i < PROF_THREADS; i++) P.sp[i] = 0, P.last_id[i] = 0;
}

NO_INSTR static void record(unsigned t, uintptr_t pc);

HOOK void __cyg_profile_func_enter(void *fn, void *site)
{
    (void)fn;
    if (!emu_self_) return;
    unsigned t = emu_self_->linear;
    if (t >= PROF_THREADS) return;
    if (P.sp[t] < PROF_DEPTH) P.stack[t][P.sp[t]] = (uintptr_t)site;
    P.sp[t]++;
    uint32_t id = P.last_id[t];
    if (id && !P.failed && P.lane[(size_t)t * P.cap_keys + id - 1] > 0) {
        P.lane[(size_t)t * P.cap_keys + id - 1]--;
        P.last_id[t] = 0;
        record(t, P.last_pc[t]);
    }
}

HOOK void __cyg_profile_func_exit(void *fn, void *site)
{
    (void)fn, (void)site;
    if (!emu_self_) return;
    unsigned t = emu_self_->linear;
    if (t < PROF_THREADS && P.sp[t] > 0) P.sp[t]--;
}

NO_INSTR static void record(unsigned t, uintptr_t pc)
{
    prof_key k;
    int d = P.sp[t] < PROF_DEPTH ? P.sp[t] : PROF_DEPTH;
    k.pc[0] = pc;
    for (int i = 0; i < d; i++) k.pc[1 + i] = P.stack[t][d - 1 - i];
    k.depth = d + 1;
    uint64_t h = hash_chain(k.pc, k.depth);
    for (;;) {
        if (P.cap_keys == 0 && grow() != 0) {
            P.failed = 1;
            return;
        }
        uint64_t s = h & (2 * P.cap_keys - 1);
        for (;;) {
            uint32_t id = P.index[s];
            if (id == 0) break;
            const prof_key *o = &P.keys[id - 1];
            if (o->depth == k.depth && !memcmp(o->pc, k.pc, (size_t)k.depth * sizeof k.pc[0])) {
                P.lane[(size_t)t * P.cap_keys + id - 1]++;
                if (!P.is_touched[id - 1]) P.is_touched[id - 1] = 1, P.touched[P.n_touched++] = id - 1;
                P.last_id[t] = id, P.last_pc[t] = pc;
                return;
            }
            s = (s + 1) & (2 * P.cap_keys - 1);
        }
        if (P.n_keys == P.cap_keys) {
            if (grow() != 0) {
                P.failed = 1;
                return;
            }
            continue; /* the table was rebuilt: look again */
        }
        k.warp_count = 0;
        P.keys[P.n_keys] = k;
        P.index[s] = ++P.n_keys;
    }
}

HOOK void __sanitizer_cov_trace_pc(void)
{
    if (!emu_self_ || P.failed) return;
    unsigned t = emu_self_->linear;
    if (t >= PROF_THREADS) return;
    if (!P.on) {
        P.on = 1;
        emu_block_end_hook = block_end;
    }
    record(t, (uintptr_t)__builtin_return_address(0));
}

__attribute__((destructor)) NO_INSTR static void write_profile(void)
{
    const char *path = getenv("KVQ_EMU_PROFILE");
    if (!P.on || !path || !*path) return;
    Dl_info info;
    if (!dladdr((void *)write_profile, &info) || !info.dli_fname) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "module %s %s\n", info.dli_fname, P.failed ? "incomplete" : "complete");
    for (uint32_t i = 0; i < P.n_keys; i++) {
        const prof_key *k = &P.keys[i];
        if (!k->warp_count) continue;
        fprintf(f, "%llu %d", (unsigned long long)k->warp_count, k->depth);
        for (int j = 0; j < k->depth; j++)
            fprintf(f, " %lx", (unsigned long)(k->pc[j] - (uintptr_t)info.dli_fbase - 1)); /* in the call */
        fputc('\n', f);
    }
    fclose(f);
    free(P.keys);
    free(P.index);
    free(P.lane);
    free(P.touched);
    free(P.is_touched);
}
