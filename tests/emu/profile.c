/* Warp-level execution profile of emulated kernels, for kvqc build's cost model (docs/cuda.md, "Cost model").
 *
 * The kernel translation unit is compiled with -finstrument-functions (every call: enter/exit) and
 * -fsanitize-coverage=trace-pc (every basic block calls __sanitizer_cov_trace_pc). A block's key is its address
 * plus the call sites on the thread's stack, so the same source line reached through different calls (the GPU
 * compiler inlines every call) is counted apart. The stack is kept per GPU thread as a node of a call-context
 * tree (node = parent node + call site), so a key is two words (node, block) whatever the depth: the enter hook
 * looks its child node up once a call, a basic block costs one two-word hash probe.
 *
 * A warp issues an instruction once for all its active lanes: after each thread block, a key's count for a warp
 * is the largest count of its lanes (exact for code the lanes run in step and for code only some lanes run; a
 * lower bound where lanes take a branch at different iterations), times the block's weight (exec.c: a sampled
 * launch runs one block for `weight` identical ones, $KVQ_EMU_SAMPLE). The totals over warps and blocks are
 * written to $KVQ_EMU_PROFILE when the module is unloaded: a header line with the module's path, a line per
 * sampled launch ("sample KERNEL DIM N"), then one line per key: warp count, depth, then the offsets in the
 * module of the block and of each call site, innermost first. Only launches exec.c marks as profiled count
 * ($KVQ_EMU_PROFILE_KERNELS). Inert (never called) in a module compiled without the two instrumentation flags. */
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

/* a two-word open-addressing map (a, b) -> id + 1, a slot's words side by side (one cache line a probe) */
typedef struct {
    uintptr_t a, b;
    uint32_t id;
} map_slot;
typedef struct {
    map_slot *slot;
    uint32_t cap; /* slots, a power of two */
} map2;

typedef struct {
    uintptr_t site;  /* the call site */
    uint32_t parent; /* node id; 0 is the root (the kernel's entry) */
    int depth;       /* call sites from the root */
} ctx_node;

typedef struct {
    uintptr_t pc;
    uint32_t ctx;
    uint64_t warp_count;
} prof_key;

static struct {
    int on, failed;
    uint32_t ctx[PROF_THREADS];                 /* the thread's current node */
    uint32_t ctx_stack[PROF_THREADS][PROF_DEPTH]; /* the nodes below it, for the exit hook */
    int sp[PROF_THREADS];                       /* calls deep (may pass PROF_DEPTH: deeper calls share a node) */
    ctx_node *nodes;
    uint32_t n_nodes, cap_nodes;
    map2 node_map, key_map;
    prof_key *keys;
    uint32_t n_keys, cap_keys;
    /* [cap_keys][stride]: this block's per-thread counts, a key's lanes side by side (the block's working set is
     * the keys it touched); stride: the most threads a block had so far, rounded up to a power of two */
    uint32_t *lane;
    unsigned stride;
    uint32_t *touched; /* the keys this block counted (block_end folds only these: a launch of many small
                        * blocks would otherwise cost keys x threads a block) */
    unsigned char *is_touched;
    uint32_t n_touched;
    /* the thread's last block: a function's first block is reported before its enter hook runs, so the enter
     * hook moves that count to the key with the new call site */
    uint32_t last_id[PROF_THREADS];
    uintptr_t last_pc[PROF_THREADS];
} P;

NO_INSTR static uint64_t hash2(uintptr_t a, uintptr_t b)
{
    uint64_t h = ((uint64_t)a * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)b + 0x632be59bd9b4e019ull) * 0xc2b2ae3d27d4eb4full;
    return h ^ h >> 31;
}

NO_INSTR static uint32_t map_get(const map2 *m, uintptr_t a, uintptr_t b, uint64_t *slot)
{
    if (!m->cap) return 0;
    uint64_t s = hash2(a, b) & (m->cap - 1);
    while (m->slot[s].id && (m->slot[s].a != a || m->slot[s].b != b)) s = (s + 1) & (m->cap - 1);
    *slot = s;
    return m->slot[s].id;
}

NO_INSTR static void map_put(map2 *m, uint64_t s, uintptr_t a, uintptr_t b, uint32_t id)
{
    m->slot[s].a = a, m->slot[s].b = b, m->slot[s].id = id;
}

/* room for one more entry when n entries are held (load at most 1/2) */
NO_INSTR static int map_reserve(map2 *m, uint32_t n)
{
    if (2 * (uint64_t)(n + 1) <= m->cap) return 0;
    uint32_t cap = m->cap ? 2 * m->cap : 8192;
    map_slot *g = calloc(cap, sizeof *g);
    if (!g) return -1;
    for (uint32_t i = 0; i < m->cap; i++)
        if (m->slot[i].id) {
            uint64_t s = hash2(m->slot[i].a, m->slot[i].b) & (cap - 1);
            while (g[s].id) s = (s + 1) & (cap - 1);
            g[s] = m->slot[i];
        }
    free(m->slot);
    m->slot = g, m->cap = cap;
    return 0;
}

/* the lane counts laid out for `stride` threads a key (a wider block than any before: the counts so far kept) */
NO_INSTR static int set_stride(unsigned stride)
{
    uint32_t *lane = calloc((size_t)(P.cap_keys ? P.cap_keys : 1) * stride, sizeof *lane);
    if (!lane) return -1;
    for (uint32_t k = 0; k < P.cap_keys && P.lane; k++)
        memcpy(lane + (size_t)k * stride, P.lane + (size_t)k * P.stride, P.stride * sizeof *lane);
    free(P.lane);
    P.lane = lane, P.stride = stride;
    return 0;
}

NO_INSTR static int grow_keys(void)
{
    uint32_t cap = P.cap_keys ? 2 * P.cap_keys : 4096;
    prof_key *k = realloc(P.keys, (size_t)cap * sizeof *k);
    if (k) P.keys = k;
    if (!P.stride) P.stride = 128;
    uint32_t *lane = k ? realloc(P.lane, (size_t)P.stride * cap * sizeof *lane) : NULL;
    if (lane) P.lane = lane;
    uint32_t *touched = lane ? realloc(P.touched, (size_t)cap * sizeof *touched) : NULL;
    if (touched) P.touched = touched;
    unsigned char *is_touched = touched ? realloc(P.is_touched, cap) : NULL;
    if (is_touched) P.is_touched = is_touched;
    if (!k || !lane || !touched || !is_touched) return -1;
    memset(is_touched + P.cap_keys, 0, cap - P.cap_keys);
    memset(lane + (size_t)P.stride * P.cap_keys, 0, (size_t)P.stride * (cap - P.cap_keys) * sizeof *lane);
    P.cap_keys = cap;
    return 0;
}

/* After each thread block: a warp's count of a key is the largest of its lanes', times the block's weight */
NO_INSTR static void block_end(unsigned n, unsigned long long weight)
{
    if (n > PROF_THREADS) n = PROF_THREADS;
    for (uint32_t i = 0; i < P.n_touched; i++) {
        const uint32_t k = P.touched[i];
        P.is_touched[k] = 0;
        for (unsigned w = 0; w * 32 < n; w++) {
            uint32_t mx = 0;
            for (unsigned l = w * 32; l < n && l < w * 32 + 32 && l < P.stride; l++) { /* wider: never counted */
                uint32_t *c = &P.lane[(size_t)k * P.stride + l];
                if (*c > mx) mx = *c;
                *c = 0;
            }
            P.keys[k].warp_count += (uint64_t)mx * weight;
        }
    }
    P.n_touched = 0;
    for (unsigned i = 0; i < PROF_THREADS; i++) P.sp[i] = 0, P.ctx[i] = 0, P.last_id[i] = 0;
}

NO_INSTR static void record(unsigned t, uintptr_t pc);

HOOK void __cyg_profile_func_enter(void *fn, void *site)
{
    (void)fn;
    /* emu_profiling first: a plain load, where emu_self_ is thread-local (a call in a shared object); the hooks
     * run at every call and basic block of the unprofiled kernels too */
    if (!emu_profiling || P.failed || !emu_self_) return;
    unsigned t = emu_self_->linear;
    if (t >= PROF_THREADS) return;
    if (P.sp[t] < PROF_DEPTH) {
        const uint32_t parent = P.ctx[t];
        uint64_t s = 0;
        uint32_t id = map_get(&P.node_map, (uintptr_t)site, parent, &s);
        if (!id) {
            if (P.n_nodes + 1 >= P.cap_nodes) {
                uint32_t cap = P.cap_nodes ? 2 * P.cap_nodes : 4096;
                ctx_node *n = realloc(P.nodes, (size_t)cap * sizeof *n);
                if (!n) {
                    P.failed = 1;
                    return;
                }
                P.nodes = n, P.cap_nodes = cap;
            }
            if (P.n_nodes == 0) P.nodes[0] = (ctx_node){0, 0, 0}, P.n_nodes = 1; /* the root */
            if (map_reserve(&P.node_map, P.n_nodes) != 0) {
                P.failed = 1;
                return;
            }
            map_get(&P.node_map, (uintptr_t)site, parent, &s);
            id = P.n_nodes++;
            P.nodes[id] = (ctx_node){(uintptr_t)site, parent, P.nodes[parent].depth + 1};
            map_put(&P.node_map, s, (uintptr_t)site, parent, id);
        }
        P.ctx_stack[t][P.sp[t]] = parent;
        P.ctx[t] = id;
    }
    P.sp[t]++;
    uint32_t id = P.last_id[t];
    if (id && t < P.stride && P.lane[(size_t)(id - 1) * P.stride + t] > 0) {
        P.lane[(size_t)(id - 1) * P.stride + t]--;
        P.last_id[t] = 0;
        record(t, P.last_pc[t]);
    }
}

HOOK void __cyg_profile_func_exit(void *fn, void *site)
{
    (void)fn, (void)site;
    if (!emu_profiling || !emu_self_) return;
    unsigned t = emu_self_->linear;
    if (t >= PROF_THREADS || P.sp[t] == 0) return;
    P.sp[t]--;
    if (P.sp[t] < PROF_DEPTH) P.ctx[t] = P.ctx_stack[t][P.sp[t]];
}

NO_INSTR static void record(unsigned t, uintptr_t pc)
{
    const uint32_t ctx = P.ctx[t];
    uint64_t s = 0;
    uint32_t id = map_get(&P.key_map, pc, ctx, &s);
    if (!id) {
        if ((P.n_keys == P.cap_keys && grow_keys() != 0) || map_reserve(&P.key_map, P.n_keys) != 0) {
            P.failed = 1;
            return;
        }
        map_get(&P.key_map, pc, ctx, &s);
        P.keys[P.n_keys] = (prof_key){pc, ctx, 0};
        id = ++P.n_keys;
        map_put(&P.key_map, s, pc, ctx, id);
    }
    if (t >= P.stride) {
        unsigned st = P.stride;
        while (st <= t) st *= 2;
        if (set_stride(st) != 0) {
            P.failed = 1;
            return;
        }
    }
    P.lane[(size_t)(id - 1) * P.stride + t]++;
    if (!P.is_touched[id - 1]) P.is_touched[id - 1] = 1, P.touched[P.n_touched++] = id - 1;
    P.last_id[t] = id, P.last_pc[t] = pc;
}

HOOK void __sanitizer_cov_trace_pc(void)
{
    if (!emu_profiling || P.failed || !emu_self_) return;
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
    for (int i = 0; i < emu_n_samples; i++)
        fprintf(f, "sample %s %c %u\n", emu_samples[i].kernel, emu_samples[i].dim, emu_samples[i].n);
    for (uint32_t i = 0; i < P.n_keys; i++) {
        const prof_key *k = &P.keys[i];
        if (!k->warp_count) continue;
        fprintf(f, "%llu %d %lx", (unsigned long long)k->warp_count, P.nodes ? P.nodes[k->ctx].depth + 1 : 1,
                (unsigned long)(k->pc - (uintptr_t)info.dli_fbase - 1)); /* in the call */
        for (uint32_t c = k->ctx; c != 0; c = P.nodes[c].parent)
            fprintf(f, " %lx", (unsigned long)(P.nodes[c].site - (uintptr_t)info.dli_fbase - 1));
        fputc('\n', f);
    }
    fclose(f);
    free(P.keys);
    free(P.nodes);
    free(P.lane);
    free(P.touched);
    free(P.is_touched);
    free(P.node_map.slot);
    free(P.key_map.slot);
}
