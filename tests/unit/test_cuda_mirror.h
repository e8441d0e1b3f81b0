/* Test helper (header-only): decode tiles (kvq_params.cuh) over the reference backend's own storage. The
 * reference keeps exactly layout.h's pages and fp16 windows, so a kernel can attend over them as they are: on the
 * emulator device addresses are host addresses, and a GPU test copies each container to the device first (the
 * `xlate` callback maps a host buffer to its device address).
 *
 * Token order: in a quant-mode layer the keys' stream (pages in list order, then the window) and the values'
 * stream enumerate the same tokens in the same order for every kv head (KIVI, OTT and ZipCache alike); sinks,
 * the outlier pool and the spill pool pair K and V slot by slot. tm_check_pairing verifies that from the
 * positions the reference records. */
#ifndef KVQ_TEST_CUDA_MIRROR_H
#define KVQ_TEST_CUDA_MIRROR_H

#include <stdint.h>
#include <string.h>

#include "alloc.h"
#include "kvq_params.cuh"
#include "plan.h"
#include "ref/ref.h"

typedef uint64_t (*tm_xlate)(const void *host, size_t bytes, void *ctx);

typedef struct {
    uint64_t base;
    int kind, cap, slot, n;
    const int *pos; /* positions of the run's slots for head 0 .. (pos_stride apart per head), or NULL */
    int pos_stride; /* 0: the same positions for every head */
} tm_run;

typedef struct {
    kvq_tile *t;
    int n, cap;
} tm_tiles;

static void tm_push(tm_tiles *ts, kvq_tile t)
{
    if (ts->n == ts->cap) {
        ts->cap = ts->cap ? 2 * ts->cap : 64;
        ts->t = kvq_realloc(ts->t, (size_t)ts->cap * sizeof *ts->t);
    }
    ts->t[ts->n++] = t;
}

/* A K/V pair of runs of the same length, cut into tiles of at most `tile` tokens. */
static void tm_pair(tm_tiles *ts, const tm_run *k, const tm_run *v, int n, int tile, uint64_t count)
{
    for (int o = 0; o < n; o += tile) {
        kvq_tile t;
        memset(&t, 0, sizeof t);
        t.k = k->base, t.v = v->base;
        t.k_slot = k->slot + o, t.v_slot = v->slot + o;
        t.k_cap = k->cap, t.v_cap = v->cap;
        t.n = n - o < tile ? n - o : tile;
        t.kinds = k->kind | v->kind << 8;
        t.count = count;
        tm_push(ts, t);
    }
}

/* The tile limit of a pair of runs (plan_tile_tokens: fp16 rows take fewer tokens than pages). */
static int tm_lim(const plan_class *pc, const tm_run *k, const tm_run *v)
{
    return plan_tile_tokens(pc, k->kind == KVQ_SRC_F16, v->kind == KVQ_SRC_F16);
}

/* Merges two streams of runs covering the same tokens into tiles. */
static void tm_merge(tm_tiles *ts, const tm_run *kr, int nk, const tm_run *vr, int nv, const plan_class *pc)
{
    int i = 0, j = 0, ko = 0, vo = 0;
    while (i < nk && j < nv) {
        if (ko == kr[i].n) {
            i++, ko = 0;
            continue;
        }
        if (vo == vr[j].n) {
            j++, vo = 0;
            continue;
        }
        int n = kr[i].n - ko < vr[j].n - vo ? kr[i].n - ko : vr[j].n - vo;
        tm_run a = kr[i], b = vr[j];
        a.slot += ko, b.slot += vo;
        tm_pair(ts, &a, &b, n, tm_lim(pc, &a, &b), 0);
        ko += n, vo += n;
    }
}

static int tm_page_kind(const ref_page *pg)
{
    if (pg->fmt.bits >= 16) return KVQ_SRC_F16;
    return pg->seg == KVQ_SEG_BODY_LOW ? KVQ_SRC_LO : KVQ_SRC_HI;
}

/* The body + window stream of tensor `which` of a quant layer; returns the number of runs. */
static int tm_stream(const ref_qlayer *L, int which, tm_run *runs, tm_xlate x, void *ctx)
{
    int n = 0;
    const ref_pages *pl = &L->pages[which];
    for (int j = 0; j < pl->n; j++) {
        const ref_page *pg = pl->v[j];
        tm_run r = {x(pg->mem, pg->lay.total, ctx),
                    tm_page_kind(pg),
                    pg->fmt.capacity,
                    0,
                    pg->count,
                    pg->pos,
                    pg->fmt.capacity};
        if (pg->count > 0) runs[n++] = r;
    }
    const ref_win *w = &L->win[which];
    if (w->count > 0) {
        tm_run r = {x(w->data, w->bytes, ctx), KVQ_SRC_F16, w->cap, 0, w->count, w->pos, 0};
        runs[n++] = r;
    }
    return n;
}

static int tm_run_pos(const tm_run *r, int h, int s) { return r->pos[(size_t)h * (size_t)r->pos_stride + (size_t)s]; }

/* 1 if the K and V streams hold the same positions in the same order for every head. */
static int tm_check_pairing(const tm_run *kr, int nk, const tm_run *vr, int nv, int H)
{
    for (int h = 0; h < H; h++) {
        int i = 0, j = 0, ko = 0, vo = 0;
        for (;;) {
            while (i < nk && ko == kr[i].n) i++, ko = 0;
            while (j < nv && vo == vr[j].n) j++, vo = 0;
            if (i == nk || j == nv) {
                if (i != nk || j != nv) return 0;
                break;
            }
            if (tm_run_pos(&kr[i], h, kr[i].slot + ko) != tm_run_pos(&vr[j], h, vr[j].slot + vo)) return 0;
            ko++, vo++;
        }
    }
    return 1;
}

/* Every tile of a quant layer: sinks, pools, body + windows. 0 when the pairing check fails. */
static int tm_quant_tiles(const ref_qlayer *L, const plan_class *pc, tm_tiles *ts, tm_xlate x, void *ctx)
{
    const ref_win *sk = &L->sink[0], *sv = &L->sink[1];
    if (sk->count > 0) {
        tm_run a = {x(sk->data, sk->bytes, ctx), KVQ_SRC_F16, sk->cap, 0, sk->count, NULL, 0};
        tm_run b = {x(sv->data, sv->bytes, ctx), KVQ_SRC_F16, sv->cap, 0, sv->count, NULL, 0};
        tm_pair(ts, &a, &b, sk->count, tm_lim(pc, &a, &b), 0);
    }
    const ref_pool *pools[2] = {&L->pool, &L->spill};
    for (int i = 0; i < 2; i++) {
        const ref_pool *P = pools[i];
        if (!P->count || P->cap == 0) continue;
        /* K and V of a pool are one allocation: V at the aligned half */
        uint64_t base = x(P->k, P->bytes, ctx);
        tm_run a = {base, KVQ_SRC_F16, P->cap, 0, P->cap, NULL, 0};
        tm_run b = {
            base + (uint64_t)((const uint8_t *)P->v - (const uint8_t *)P->k), KVQ_SRC_F16, P->cap, 0, P->cap, NULL, 0};
        tm_pair(ts, &a, &b, P->cap, tm_lim(pc, &a, &b), x(P->count, (size_t)P->H * sizeof(int), ctx));
    }
    tm_run kr[4096], vr[4096];
    int nk = tm_stream(L, 0, kr, x, ctx), nv = tm_stream(L, 1, vr, x, ctx);
    if (!tm_check_pairing(kr, nk, vr, nv, L->H)) return 0;
    tm_merge(ts, kr, nk, vr, nv, pc);
    return 1;
}

#endif
