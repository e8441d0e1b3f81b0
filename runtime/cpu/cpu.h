/* The cpu backend's internals (docs/cpu.md). Storage, streaming rules, policies, prefill, accounting and
 * read_cache are the reference backend's (runtime/ref): the same pages by construction. What the cpu backend
 * replaces is the attention of a decode step: LLVM-compiled tile kernels (compiler/emit_llvm.h) over the
 * (sequence, kv head, KV chunk) tasks of a batch, run by a thread pool and merged by (o, lse). */
#ifndef KVQ_CPU_H
#define KVQ_CPU_H

#include <stdatomic.h>
#include <stddef.h>

#include "emit_llvm.h"
#include "plan.h"
#include "ref.h"

/* ---- thread pool (cpu_pool.c): persistent workers; the calling thread works too ---- */
typedef struct cpu_pool cpu_pool;
typedef void (*cpu_task_fn)(void *arg, int task);

/* threads: 0 = the machine's online cores; 1 = no worker threads. */
kvq_status cpu_pool_create(int threads, cpu_pool **out);
void cpu_pool_free(cpu_pool *p);
int cpu_pool_threads(const cpu_pool *p);
/* Runs fn(arg, i) for every i in [0, n) and returns when all have finished. */
void cpu_pool_run(cpu_pool *p, cpu_task_fn fn, void *arg, int n);

/* ---- kernels of one layer class: every (K source, V source) pair its pages can present ---- */
#define CPU_MAX_SRC EMIT_LLVM_MAX_SRC
typedef struct {
    emit_llvm_sources src; /* [0] = fp16 rows, then page formats */
    emit_llvm_tile_fn fn[CPU_MAX_SRC][CPU_MAX_SRC];
    int tile; /* the plan's tile (plan_class.tile, at most EMIT_LLVM_TILE): tiles are cut to it by kvq_tile_len */
} cpu_class;

typedef struct {
    kvq_plan plan;
    cpu_class cls[PLAN_MAX_CLASSES];
    emit_llvm_jit *jit;
    const char *origin; /* where the kernels' object came from: "generated", "cache" or "jit" (cpu_aot.h) */
    cpu_pool *pool;
} cpu_state;

/* cpu_kernels.c: builds the plan of the engine and compiles every class's kernels. */
kvq_status cpu_kernels_build(const kvq_be_engine *e, cpu_state *s, char *msg, size_t msg_size);
/* The source index of a page of format f among a class's K (which 0) or V (1) sources; -1 if not planned. */
int cpu_class_source(const cpu_class *c, int which, const kvq_page_format *f);

/* ---- cpu_attend.c: attention of quantize-mode layers over the reference's storage ---- */

/* A run of slots of one source (an fp16 window or a page) of one kv head. */
typedef struct {
    const ref_page *pg;    /* NULL: fp16 rows */
    const uint16_t *rows;  /* fp16 rows: slot 0's row (pools: the K rows) */
    const uint16_t *vrows; /* pools: the V rows */
    const int *pos;        /* positions of the span's slots */
    int n, src;            /* slots; source index in the class */
    int first;             /* pos[0]: the V search reads the spans, not the pages' position arrays */
    int consec;            /* positions are first, first + 1, ...: the tile loop reads no position array */
    int paged;             /* per-channel key page: its kernels read the keys through page descriptors */
    /* K spans of a page run (ref_page.run_len, layout/tiles.h): the run's first span has run = its spans in this
     * list and rn = their slots (full pages of pcap slots, consecutive positions), and tiles span them; any
     * other span has run = 1, rn = n, pcap = 0 */
    int run, rn, pcap;
    /* Pages, for this kv head, resolved once per step so that the tile loop never reads the page's header:
     * slot 0's codes and parameters, the channel factors, the mask row; bytes per slot (codes, scale, zero: 0 for
     * a per-channel section) and the per-channel sections' bytes (prefetch). */
    const uint8_t *x, *sc, *z, *f, *mask;
    size_t xb, sb, zb, sfix, zfix, fb;
    const float *t; /* element formats with a tensor scale: this kv head's T (layout.h tscale), else NULL */
    const uint8_t *qjl; /* TurboQuant prod keys: slot 0's QJL sign row (D / 8 bytes a slot), else NULL */
} cpu_span;

/* Per (sequence, kv head) of a decode step. */
typedef struct {
    cpu_span *ks, *vs, *pools; /* K spans in storage order, V spans sorted by first position, pool spans */
    int nk, nv, npool;
    int total;                 /* K slots over the K spans */
    int *vmap;                 /* [2][length]: V span and slot of each position (saliency layers), else NULL */
    int broken;                /* the storage broke an invariant */
} cpu_head;

/* What one sequence's attention needs, sized before the step mutates anything (all-or-nothing decode). */
typedef struct {
    const ref_qlayer *L;
    const cpu_class *cls;
    const float *q;   /* [Hq][D] */
    float *out;       /* [Hq][D] */
    float *qs;        /* [Hq][D] q times the softmax scale */
    float *sq;        /* TurboQuant prod keys: [Hq][D] sqrt(pi/2)/m_j S_j qs (emit_llvm_turboquant.h), else NULL */
    int chunks;       /* KV chunks per kv head */
    cpu_head *heads;  /* [H] */
    float *state;     /* [H][chunks][g * (D + 2 + EMIT_LLVM_TILE)] */
    int span_cap, use_vmap;
    atomic_int bad;   /* a K slot whose V was not found (an invariant broken); set by any chunk's task */
} cpu_item;

/* Before the step: fixes the item's chunks and span capacity for layer L after a step that adds at most
 * new_pages pages (a batch of n_items on `threads`), and returns the bytes cpu_item_init will take. */
size_t cpu_item_size(cpu_item *it, const ref_qlayer *L, int new_pages, int threads, int n_items);
/* After step_begin: carves the item's buffers from `a` (sized by cpu_item_size) and scales the query. */
void cpu_item_init(cpu_item *it, const ref_qlayer *L, const cpu_class *cls, ref_arena *a);
/* Task phases over a batch: spans of (item, head), tiles of (item, head, chunk), the merge of (item, head). */
void cpu_item_spans(cpu_item *it, int h);
void cpu_item_tiles(cpu_item *it, int h, int chunk);
void cpu_item_merge(cpu_item *it, int h);
/* The tiles of kv head h, chunk by chunk, as cpu_item_tiles cuts them (pools first): the count (at most cap
 * written to out), or -1 if the storage broke an invariant. After cpu_item_spans. */
int cpu_item_tile_list(cpu_item *it, int h, kvq_tile_info *out, int cap);
/* 0 if the storage broke an invariant (a token without its value, or not once). */
int cpu_item_ok(const cpu_item *it);

#endif
