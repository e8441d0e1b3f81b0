/* The decode tiles of planned steps on the device (docs/cuda.md "Planned steps"; issue 10 item 3: device page
 * tables instead of host-built tile lists).
 *
 * A quantized layer's tile list is [sinks][OTT pools][body pages][window ring runs] (cu_qlayer_tiles). Body tokens
 * never move once quantized: pages are only ever appended, a flush writes its pages whole and only the append page
 * grows, so every body tile before the first one that reads the append page or the window is the same at every
 * later step. Each sequence therefore keeps, per layer, its list in device memory (one array per sequence from the
 * engine's pool, sized by the step capacity, made when the sequence first enters a plan and freed with it) and a
 * host mirror of it. A plan recomputes only
 * - the head (the sinks' and pools' tiles: a few, bounded by the configuration; OTT's flip between its two copies
 *   every step), compared with the mirror's, and
 * - the tail: the body's merge resumed from the position after the last stable tile (cu_qlayer_body_tiles), so
 *   the host work per step is O(tiles after the append page's start), not O(T);
 * and sends the tiles that differ as at most CU_STEP_PATCHES (destination, tiles) patches inside the step's one
 * upload; the run copies them into place (kvq_tiles_patch) before the decode launch. The list the kernel reads is
 * the one cu_qlayer_tiles would build, tile for tile (test_cuda_replay reads it back and compares).
 *
 * Consistency: the mirror describes the device list after the runs of every committed plan. A plan only stages
 * its result (cu_tl.p_*); cu_step_tiles_commit adopts it when the whole plan succeeded, so a failed plan changes
 * neither the mirror nor the device list. A failed run (its patches may not have landed) and a new prefill of the
 * layer mark the list unknown (cu_step_tiles_forget): the next plan sends it whole. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_backend.h"

size_t cu_step_tiles_seq_bytes(const kvq_backend_ctx *c)
{
    return (size_t)c->e.dims.layers * (size_t)c->step.tiles_cap * sizeof(kvq_tile);
}

static size_t seq_bytes(const kvq_backend_seq *s) { return (size_t)s->n_layers * (size_t)s->tl.cap * sizeof(kvq_tile); }

kvq_status cu_step_tiles_prepare(kvq_backend_ctx *c, kvq_backend_seq *s, char *msg, size_t ms)
{
    if (!s->tl.layer) {
        s->tl.layer = kvq_calloc((size_t)s->n_layers, sizeof *s->tl.layer);
        if (!s->tl.layer) {
            snprintf(msg, ms, "out of memory");
            return KVQ_ERR_NOMEM;
        }
    }
    if (s->tl.addr && s->tl.cap >= c->step.tiles_cap) return KVQ_OK;
    uint64_t a = 0;
    kvq_status st = cu_pool_get(c, cu_step_tiles_seq_bytes(c), &a, msg, ms);
    if (st != KVQ_OK) return st;
    /* the old array's lists are not carried over: an empty array whose layers are unknown is consistent. Its
     * block is zeroed on the plan's stream (cu_pool_put), after the steps queued there that still read it. */
    cu_pool_put(c, s->tl.addr, seq_bytes(s));
    s->tl.addr = a, s->tl.cap = c->step.tiles_cap;
    for (int l = 0; l < s->n_layers; l++) s->tl.layer[l].valid = 0;
    return KVQ_OK;
}

kvq_status cu_step_tiles_plan(kvq_backend_ctx *c, kvq_backend_seq *s, int l, unsigned char *tb, uint64_t dev,
                              size_t *tiles_at, kvq_tile_patch *patch, kvq_seq_tiles *sq, char *msg, size_t ms)
{
    const cu_step *S = &c->step;
    const cu_layer *LL = s->layers[l];
    int cls = c->plan->layer_class[l];
    if (!s->tl.layer || !s->tl.addr || s->tl.cap < S->tiles_cap) {
        snprintf(msg, ms, "cuda: internal error: a sequence's device tile lists were not prepared for the plan");
        return KVQ_ERR_INTERNAL;
    }
    cu_tl *T = &s->tl.layer[l];
    memset(patch, 0, CU_STEP_PATCHES * sizeof *patch);
    /* c->htiles: [0, h) the head of the list; [h, nt) the list's tiles [base, base + nt - h) */
    int nt = 0, h = 0, full = !T->valid, base = 0, fz_nt = 0;
    cu_tile_cursor from = {0, 0, 0, 0}, fz_at = from;
    if (LL->sparse) {
        /* TailorKV's sparse layers select their rows inside the step: the whole list, compared with the mirror
         * (no head, nothing stable) */
        cu_slayer_tiles(c, &LL->s, &nt);
    } else {
        cu_qlayer_head_tiles(c, &LL->q, &nt);
        h = nt, full |= h != T->head;
        if (!full) from = T->at;
        base = full ? h : T->stable, fz_at = from;
        if (nt >= 0) cu_qlayer_body_tiles(c, &LL->q, from, &nt, &fz_nt, &fz_at);
    }
    if (nt < 0) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    c->step.tiles_built += nt;
    int n_new = base + (nt - h);
    if (n_new > S->tiles_cap) {
        snprintf(msg, ms, "%d decode tiles, beyond the %d the step capacity allows", n_new, S->tiles_cap);
        return KVQ_ERR_SHAPE;
    }
    for (int j = 0; j < nt; j++) {
        int kinds = c->htiles[j].kinds, lim = plan_tile_tokens(&c->plan->cls[cls], (kinds & 255) == KVQ_SRC_F16,
                                                                ((kinds >> 8) & 255) == KVQ_SRC_F16);
        if (c->htiles[j].n > lim) {
            snprintf(msg, ms, "cuda: internal error: a decode tile of %d tokens, the plan's tile is %d",
                     c->htiles[j].n, lim);
            return KVQ_ERR_INTERNAL;
        }
    }
    if (T->cap < n_new) { /* grown now, so the commit cannot fail */
        int cap = T->cap * 2 > n_new ? T->cap * 2 : n_new;
        kvq_tile *m = kvq_realloc(T->mirror, (size_t)cap * sizeof *m);
        if (!m) {
            snprintf(msg, ms, "out of memory");
            return KVQ_ERR_NOMEM;
        }
        T->mirror = m, T->cap = cap;
    }
    /* the changed ranges [first, first + count) of the list, their tiles at c->htiles + hidx */
    int first[CU_STEP_PATCHES] = {0}, count[CU_STEP_PATCHES] = {0}, hidx[CU_STEP_PATCHES] = {0}, np = 0;
    if (full) {
        first[0] = 0, count[0] = n_new, hidx[0] = 0, np = 1; /* base == h: the list is c->htiles[0, nt) */
    } else {
        int a = 0, b = h;
        while (a < b && !memcmp(&c->htiles[a], &T->mirror[a], sizeof(kvq_tile))) a++;
        while (b > a && !memcmp(&c->htiles[b - 1], &T->mirror[b - 1], sizeof(kvq_tile))) b--;
        if (b > a) first[np] = a, count[np] = b - a, hidx[np] = a, np++;
        int f = base, same = n_new < T->n ? n_new : T->n;
        while (f < same && !memcmp(&c->htiles[h + f - base], &T->mirror[f], sizeof(kvq_tile))) f++;
        if (f < n_new) first[np] = f, count[np] = n_new - f, hidx[np] = h + f - base, np++;
    }
    uint64_t arr = s->tl.addr + (uint64_t)l * s->tl.cap * sizeof(kvq_tile);
    for (int k = 0; k < np; k++) {
        size_t bytes = (size_t)count[k] * sizeof(kvq_tile);
        memcpy(tb + *tiles_at, &c->htiles[hidx[k]], bytes);
        patch[k].dst = arr + (uint64_t)first[k] * sizeof(kvq_tile);
        patch[k].src = dev + *tiles_at;
        patch[k].n = count[k];
        T->p_first[k] = first[k], T->p_count[k] = count[k];
        T->p_src[k] = (const kvq_tile *)(tb + *tiles_at);
        *tiles_at += bytes;
    }
    for (int k = np; k < CU_STEP_PATCHES; k++) T->p_count[k] = 0;
    T->p_n = n_new, T->p_head = h, T->p_stable = base + (fz_nt - h), T->p_at = fz_at, T->p_valid = 1;
    sq->tiles = arr;
    sq->n_tiles = n_new;
    return KVQ_OK;
}

void cu_step_tiles_commit(kvq_backend_seq *s, int l)
{
    cu_tl *T = s->tl.layer ? &s->tl.layer[l] : NULL;
    if (!T || !T->p_valid) return;
    for (int k = 0; k < CU_STEP_PATCHES; k++)
        if (T->p_count[k]) memcpy(T->mirror + T->p_first[k], T->p_src[k], (size_t)T->p_count[k] * sizeof(kvq_tile));
    T->n = T->p_n, T->head = T->p_head, T->stable = T->p_stable, T->at = T->p_at;
    T->valid = 1, T->p_valid = 0;
}

void cu_step_tiles_forget(kvq_backend_seq *s, int l)
{
    if (s->tl.layer) s->tl.layer[l].valid = 0, s->tl.layer[l].p_valid = 0;
}

void cu_step_tiles_free(kvq_backend_ctx *c, kvq_backend_seq *s)
{
    cu_pool_put(c, s->tl.addr, seq_bytes(s));
    for (int l = 0; s->tl.layer && l < s->n_layers; l++) kvq_free(s->tl.layer[l].mirror);
    kvq_free(s->tl.layer);
    memset(&s->tl, 0, sizeof s->tl);
}

kvq_status cu_step_tiles_info(kvq_backend_ctx *c, const kvq_backend_seq *s, int layer, kvq_tile_info *out, int cap,
                              int *n, char *msg, size_t ms)
{
    const cu_layer *L = s->layers[layer];
    int nt = 0;
    if (L->sparse)
        cu_slayer_tiles(c, &L->s, &nt);
    else
        cu_qlayer_tiles(c, &L->q, &nt);
    if (nt < 0) {
        snprintf(msg, ms, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    for (int i = 0; i < nt && i < cap; i++) {
        const kvq_tile *t = &c->htiles[i];
        out[i].n = t->n;
        out[i].k_kind = t->kinds & 255;
        out[i].v_kind = (t->kinds >> 8) & 255;
        out[i].k_pages = kvq_tile_pages(t->n, t->k_slot, t->k_cap);
    }
    *n = nt;
    return KVQ_OK;
}
