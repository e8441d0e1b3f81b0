/* Shared-memory bank conflicts of the decode kernel's hot loops, from the addresses (docs/cuda.md "Bank
 * conflicts"). For each spec's plan, each loop that reads staged token rows and each of its row loads, the byte
 * address every lane of a warp touches is derived from the kernel's own layout functions (kvq_row_byte and
 * kvq_row_swz of templates/kvq_layout.cuh, compiled here as C; the stage offsets of the plan) and the lane
 * mapping of the loop (templates/kvq_mma.cuh kvq_scores_mma / kvq_values_mma, templates/kvq_decode.cuh
 * kvq_scores / kvq_values), then run through the bank model:
 *
 *   32 banks of 4 bytes; a warp's load of w bytes a lane is served in phases of 128 / w lanes (32 lanes for
 *   4 bytes or less, 16 for 8, 8 for 16); a phase takes as many wavefronts as the most distinct 4-byte words any
 *   one bank holds among its lanes' addresses (lanes reading the same word share it: broadcast).
 *
 * The degree of a load is its most wavefronts over phases: 1 is conflict-free. The loops whose lanes read 16, 8
 * or 4 bytes of a row (tensor-core q.K and p.V of 2- and 4-bit pages; the fp32 score and value loops on fp16 rows
 * and p.V on 8-bit rows) must be conflict-free with the swizzle, and each check also computes the unswizzled
 * layout's degree, which must be worse where the swizzle is doing the work (else the check proves nothing).
 * The fp32 score loop over 1/2/4/8-bit codes (the GQA-1 path) loads 4 or 8 bytes a lane from 32 different rows:
 * no layout makes that conflict-free (32 words at one offset of 32-byte rows land in 8 bank groups); its degree
 * is printed, before and after, and must not grow. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "harness.h"
#include "kvq.h"
#include "kvq_layout.cuh"
#include "plan.h"

/* The wavefronts of one warp-wide load: addr[l] the byte address of lane l (-1: inactive), w bytes a lane. */
static int load_degree(const long long addr[32], int w)
{
    const int per = w >= 16 ? 8 : w == 8 ? 16 : 32, words = w < 4 ? 1 : w / 4;
    int worst = 0;
    for (int ph = 0; ph < 32; ph += per) {
        long long seen[32 * 4];
        int ns = 0, nb[32] = {0};
        for (int l = ph; l < ph + per; l++) {
            if (addr[l] < 0) continue;
            for (int k = 0; k < words; k++) {
                const long long word = (addr[l] & ~3LL) / 4 + k;
                int dup = 0;
                for (int i = 0; i < ns; i++) dup |= seen[i] == word;
                if (dup) continue;
                seen[ns++] = word;
                nb[word % 32]++;
            }
        }
        for (int b = 0; b < 32; b++) worst = nb[b] > worst ? nb[b] : worst;
    }
    return worst;
}

/* The most wavefronts over the loads a loop makes; sw 0: the unswizzled layout. */
typedef struct {
    int degree[2]; /* [sw] */
    int loads;
} loop_cost;

static void note(loop_cost *c, int sw, const long long addr[32], int w)
{
    const int d = load_degree(addr, w);
    if (d > c->degree[sw]) c->degree[sw] = d;
    c->loads += sw;
}

/* kvq_scores_mma: lane (g = lane / 4, t = lane % 4) of warp w loads chunk q4 of rows m0 + g and m0 + g + 8 with
 * one 16-byte load each, for every 16-token block m0 of the tile. */
static loop_cost qk_mma(long long base, int R, int tile)
{
    loop_cost c = {{0, 0}, 0};
    for (int sw = 0; sw < 2; sw++)
        for (int m0 = 0; m0 < tile; m0 += 16)
            for (int q4 = 0; q4 < R / 16; q4++)
                for (int u = 0; u < 2; u++) {
                    long long a[32];
                    for (int l = 0; l < 32; l++) a[l] = base + kvq_row_byte(m0 + (l >> 2) + 8 * u, R, 16 * q4, sw);
                    note(&c, sw, a, 16);
                }
    return c;
}

/* kvq_values_mma: lane (g, t) of warp w reads rows k0 + 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-token block k0:
 * 2-bit rows with MPW 2 (head_dim 128) one 8-byte load of words 2w, 2w + 1 a row; else for each of its MPW channel
 * blocks mb = w MPW + i one word, mb (2-bit) or 2 mb + g / 4 (4-bit). */
static loop_cost pv_mma(long long base, int R, int bits, int D, int tile)
{
    loop_cost c = {{0, 0}, 0};
    const int nw = 4, mpw = (D / 16 + nw - 1) / nw, cw = R / 4, w2 = bits == 2 && mpw == 2 && cw % 2 == 0;
    const int rr[4] = {0, 1, 8, 9};
    for (int sw = 0; sw < 2; sw++)
        for (int k0 = 0; k0 < tile; k0 += 16)
            for (int warp = 0; warp < nw; warp++)
                for (int q = 0; q < 4; q++)
                    for (int i = 0; i < (w2 ? 1 : mpw); i++) {
                        long long a[32];
                        for (int l = 0; l < 32; l++) {
                            const int g = l >> 2, t = l & 3, mb = warp * mpw + i;
                            const int wo = w2 ? warp * mpw : bits == 2 ? mb : 2 * mb + (g >> 2);
                            a[l] = base + kvq_row_byte(k0 + 2 * t + rr[q], R, 4 * wo, sw);
                        }
                        note(&c, sw, a, w2 ? 8 : 4);
                    }
    return c;
}

/* The bytes kvq_unpack8_half / kvq_unpack8_ps / kvq_unpack8 load for the run of 8 channels at c0 (one load; an
 * 8-bit run is two words, one 8-byte load after ptxas merges them). */
static void run_load(int bits, int c0, int *off, int *w)
{
    if (bits == 16) *off = 2 * c0, *w = 16;
    else if (bits == 8) *off = c0, *w = 8;
    else *off = (c0 * bits / 8) & ~3, *w = 4;
}

/* kvq_scores: thread tid takes token lane1 and the channels part D / split + 8 j of all heads, run after run
 * (kvq_p1_lane). */
static loop_cost qk_f32(const kvq_plan *p, const plan_class *cl, long long base, int R, int bits, int tile)
{
    loop_cost c = {{0, 0}, 0};
    const int D = p->head_dim, split = cl->split, cp = D / split;
    for (int sw = 0; sw < 2; sw++)
        for (int warp = 0; warp < p->threads / 32; warp++)
            for (int j = 0; j < cp / 8; j++) {
                long long a[32];
                int w = 4;
                for (int l = 0; l < 32; l++) {
                    int part, lane1;
                    kvq_p1_lane(32 * warp + l, split, &part, &lane1);
                    const int t = lane1 % tile, c0 = part * cp + 8 * j;
                    int off;
                    run_load(bits, c0, &off, &w);
                    a[l] = base + kvq_row_byte(t, R, off, sw);
                }
                note(&c, sw, a, w);
            }
    return c;
}

/* kvq_values: thread (tx, ty, tz) = tid as x + TX (y + TY z) reads channels 8 tx of tokens tz, tz + TZ, ... */
static loop_cost pv_f32(const kvq_plan *p, long long base, int R, int bits, int tile)
{
    loop_cost c = {{0, 0}, 0};
    for (int sw = 0; sw < 2; sw++)
        for (int warp = 0; warp < p->threads / 32; warp++)
            for (int t2 = 0; t2 < tile; t2 += p->tz) {
                long long a[32];
                int w = 4;
                for (int l = 0; l < 32; l++) {
                    const int tid = 32 * warp + l, tx = tid % p->tx, tz = tid / (p->tx * p->ty), c0 = 8 * tx;
                    int off;
                    run_load(bits, c0, &off, &w);
                    a[l] = c0 < p->head_dim ? base + kvq_row_byte((t2 + tz) % tile, R, off, sw) : -1;
                }
                note(&c, sw, a, w);
            }
    return c;
}

static void check(const char *what, loop_cost c, int must_free, int *n_checked)
{
    printf("  %-58s degree %d -> %d%s\n", what, c.degree[0], c.degree[1], must_free ? "" : " (narrow loads)");
    (*n_checked)++;
    if (must_free) {
        TH_CHECK(c.degree[1] == 1, "%s: %d-way bank conflicts with the swizzle", what, c.degree[1]);
    } else {
        TH_CHECK(c.degree[1] <= c.degree[0], "%s: the swizzle made it worse (%d -> %d)", what, c.degree[0],
                 c.degree[1]);
    }
}

/* Every row-reading loop of class 0 of spec `path` at (heads, kv_heads, head_dim); returns the loops checked
 * whose unswizzled layout had conflicts. */
static int check_spec(const char *path, int heads, int kv_heads, int D, int *n_checked)
{
    kvq_spec *sp = NULL;
    kvq_plan *p = kvq_malloc(sizeof *p);
    char msg[256], what[160];
    int fixed = 0;
    TH_CHECK(kvq_spec_parse_file(th_path(path), &sp) == KVQ_OK, "%s", path);
    kvq_dims d = {4, heads, kv_heads, D};
    if (!sp || !p || plan_build(kvq_spec_scheme(sp, NULL), &d, KVQ_F32, p, msg, sizeof msg) != KVQ_OK) {
        TH_CHECK(0, "%s: plan: %s", path, msg);
        kvq_free(p);
        kvq_spec_free(sp);
        return 0;
    }
    const plan_class *cl = &p->cls[0];
    printf("  %s, GQA %d, head_dim %d (tile %d, split %d, TX %d TY %d TZ %d):\n", path, p->gqa, D, cl->tile, cl->split,
           p->tx, p->ty, p->tz);
    for (int st = 0; st < cl->stages; st++) {
        const long long kb = (long long)st * cl->stage_bytes, vbase = kb + cl->rows_k;
        /* the class's own pages (integer formats: rows this kernel stages; element formats are staged unswizzled
         * by kvq_format.cuh and not read through the swizzle) */
        const plan_store *ks = &cl->k_hi, *vs = &cl->v_hi;
        const int kint = ks->bits && ks->format.kind == KVQ_FMT_INT, vint = vs->bits && vs->format.kind == KVQ_FMT_INT;
        const int kbits = kint ? ks->bits : 16, vbits = vint ? vs->bits : 16;
        loop_cost c;
        if (kint && ks->bits < 16 && (cl->mma_k & 1)) {
            c = qk_mma(kb, plan_row_bytes(D, kbits), cl->tile);
            snprintf(what, sizeof what, "stage %d q.K tensor cores, %d-bit rows", st, kbits);
            check(what, c, 1, n_checked);
            fixed += c.degree[0] > 1;
        } else if (kint && ks->bits < 16) {
            c = qk_f32(p, cl, kb, plan_row_bytes(D, kbits), kbits, cl->tile);
            snprintf(what, sizeof what, "stage %d q.K fp32, %d-bit rows", st, kbits);
            check(what, c, kbits >= 16, n_checked);
        }
        if (vint && vs->bits < 16 && (cl->mma_v & 1)) {
            c = pv_mma(vbase, plan_row_bytes(D, vbits), vbits, D, cl->tile);
            snprintf(what, sizeof what, "stage %d p.V tensor cores, %d-bit rows", st, vbits);
            check(what, c, 1, n_checked);
            fixed += c.degree[0] > 1;
        } else if (vint && vs->bits < 16) {
            c = pv_f32(p, vbase, plan_row_bytes(D, vbits), vbits, cl->tile);
            snprintf(what, sizeof what, "stage %d p.V fp32, %d-bit rows", st, vbits);
            check(what, c, 1, n_checked);
        }
        /* fp16 rows: the fp16 pages of an fp16 class, or a quantized class's sinks, windows and pools */
        const int t16k = plan_tile_tokens(cl, 1, 0), t16v = plan_tile_tokens(cl, 0, 1);
        c = qk_f32(p, cl, kb, plan_row_bytes(D, 16), 16, t16k);
        snprintf(what, sizeof what, "stage %d q.K fp32, fp16 rows (%d tokens)", st, t16k);
        check(what, c, 1, n_checked);
        fixed += c.degree[0] > 1;
        c = pv_f32(p, vbase, plan_row_bytes(D, 16), 16, t16v);
        snprintf(what, sizeof what, "stage %d p.V fp32, fp16 rows (%d tokens)", st, t16v);
        check(what, c, 1, n_checked);
    }
    kvq_free(p);
    kvq_spec_free(sp);
    return fixed;
}

static void test_swizzle_is_a_permutation(void)
{
    th_begin("kvq_row_byte: a permutation of each row's 16-byte chunks within its 128-byte lines, every row size");
    int bad = 0, n = 0;
    for (int R = 16; R <= 1024; R += 16)
        for (int t = 0; t < 40; t++) {
            unsigned char hit[1024];
            memset(hit, 0, sizeof hit);
            for (int b = 0; b < R; b += 16) {
                const int o = kvq_row_byte(t, R, b, 1) - t * R;
                n++;
                if (o < 0 || o >= R || (o & 15) || hit[o] || (o >> 7) != (b >> 7)) bad++;
                else hit[o] = 1;
            }
        }
    TH_CHECK(bad == 0, "%d of %d chunks misplaced", bad, n);
    TH_CHECK(kvq_row_swz_ok(32) && kvq_row_swz_ok(256) && !kvq_row_swz_ok(192 + 16) && !kvq_row_swz_ok(16) &&
                 !kvq_row_swz_ok(24) && kvq_row_swz_ok(384),
             "which rows swizzle");
    th_end();
}

static void test_hot_loops(void)
{
    th_begin("decode hot loops (q.K and p.V, tensor cores and fp32, every stage): no bank conflicts from the row "
             "addresses each lane loads; the unswizzled layout had them");
    static const struct {
        const char *path;
        int heads, kv_heads, D;
    } cases[] = {
        {"specs/kivi2.kvq", 32, 8, 128},  {"specs/kivi4.kvq", 32, 8, 128},  {"specs/fp16.kvq", 32, 8, 128},
        {"specs/kivi2.kvq", 8, 8, 128},   {"specs/kivi4.kvq", 8, 8, 128},   {"specs/fp16.kvq", 8, 8, 128},
        {"specs/kivi2.kvq", 32, 8, 256},  {"specs/kivi4.kvq", 32, 8, 64},   {"specs/ott.kvq", 32, 8, 128},
        {"specs/zipcache.kvq", 32, 8, 128},
    };
    int checked = 0, fixed = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        fixed += check_spec(cases[i].path, cases[i].heads, cases[i].kv_heads, cases[i].D, &checked);
    TH_CHECK(checked >= 40, "%d loops checked", checked);
    TH_CHECK(fixed >= 10, "only %d loops had conflicts without the swizzle: the check would not notice its loss", fixed);
    th_end();
}

/* The query's per-page work on the tensor-core path, found conflicting by ncu on the H200 (docs/gpu-results.md,
 * 2026-11-27 run 4: 8-way stores, 8-way 16-byte loads, 8-way 4-byte loads) and laid out again since:
 * - kvq_fold_item_page's stores: lane l of a warp is fold item j = l of a page; its store for head h, part lo (0
 *   high, 1 low) goes to entry kb KBS + 8 h + 4 lo + t of the page (8 bytes an entry; kb = kvq_fold_item_kb(j),
 *   t = j & 3), KBS = KVQ_MMA_KBS (34; 32 before, and kb = j >> 2);
 * - kvq_fold_k's bias partials: thread i takes (page, part) = ((i & 7) | (i >> 6) << 3, (i >> 3) & 7) (before:
 *   (i / 8, i % 8)) and reads the query rows c = part D / 8 + k, G floats each (16-byte loads at GQA 4);
 * - kvq_probs on the tensor-core path: lane l takes tokens t = 2 (32 w + l) and t + 1 and reads their 2 G scores
 *   as 16-byte loads (before: 2 G loads of 4 bytes). Its 16-byte loads at a 32-byte lane stride stay 2-way: a
 *   phase's 8 lanes span 256 bytes, and only loading the halves in a lane-dependent order (8 selects a pair)
 *   would separate them. It reads the pair's fp16 value scales and zeros in one load each (before: 2-byte loads,
 *   4-way) and stores their weights, 4 bytes a lane, into blocks 8 words longer than their groups (4-way before:
 *   a warp's four blocks 64 words apart). Found in the second H200 run (run 5), after the first three were fixed. */
static int fold_kb(int j, int D, int perm)
{
    const int q = j >> 2; /* kvq_fold_item_kb */
    return perm && D % 128 == 0 ? (q & ~7) | (q & 3) << 1 | (q >> 2 & 1) : q;
}

static void test_query_fold(void)
{
    th_begin("decode per-page work on the tensor-core path: the fold's stores, bias loads and bias partials' "
             "stores, p.V's weights and the value parameters conflict-free, the probabilities' score loads 2-way (4- to 8-way each before)");
    static const int dims[] = {64, 128, 256};
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int D = dims[di], G = 4;
        int st[2] = {0, 0}, bias[2] = {0, 0};
        for (int now = 0; now < 2; now++) {
            /* the fold's stores, each page's items in turn (NI = D / 4 items; a warp is 32 of them) */
            const int ni = D / 16 * 4, kbs = now ? 34 : 32;
            for (int j0 = 0; j0 < ni; j0 += 32)
                for (int h = 0; h < G; h++)
                    for (int lo = 0; lo < 2; lo++) {
                        long long a[32];
                        for (int l = 0; l < 32; l++) {
                            const int j = j0 + l;
                            a[l] = j < ni ? 8LL * (fold_kb(j, D, now) * kbs + 8 * h + 4 * lo + (j & 3)) : -1;
                        }
                        const int d = load_degree(a, 8);
                        st[now] = d > st[now] ? d : st[now];
                    }
            /* the bias partials of 9 pages (a 256-token tile over 32-token pages, unaligned) */
            const int np = 9;
            for (int w = 0; w < 4; w++)
                for (int k = 0; k < D / 8; k++) {
                    long long a[32];
                    for (int l = 0; l < 32; l++) {
                        const int i = 32 * w + l;
                        const int pg = now ? (i & 7) | (i >> 6) << 3 : i / 8, part = now ? (i >> 3) & 7 : i % 8;
                        a[l] = pg < np ? 4LL * G * (part * (D / 8) + k) : -1;
                    }
                    const int d = load_degree(a, 16);
                    bias[now] = d > bias[now] ? d : bias[now];
                }
        }
        printf("  head_dim %d, GQA 4: fold stores degree %d -> %d, bias loads %d -> %d\n", D, st[0], st[1], bias[0], bias[1]);
        TH_CHECK(st[1] == (D % 128 == 0 ? 1 : 2) && st[0] >= 4, "head_dim %d: fold stores %d -> %d", D, st[0], st[1]);
        TH_CHECK(bias[1] == 1 && bias[0] == 8, "head_dim %d: bias loads %d -> %d", D, bias[0], bias[1]);
    }
    /* the bias partials' stores (kvq_fold_k: item i of the per-page loop stores head h's partial of part (i >> 3) & 7
     * of page (i & 7) | (i >> 6) << 3 as one float, red + kvq_bred_at), 9 pages; before, pages 8 GQA floats apart */
    for (int G = 1; G <= 8; G *= 2) {
        int before = 0, after = 0;
        const int np = 9;
        for (int now = 0; now < 2; now++)
            for (int w = 0; w < 4; w++)
                for (int h = 0; h < G; h++) {
                    long long a[32];
                    for (int l = 0; l < 32; l++) {
                        const int i = 32 * w + l, part = (i >> 3) & 7, pg = (i & 7) | (i >> 6) << 3;
                        a[l] = pg < np ? 4LL * ((now ? kvq_bred_at(G, pg, h) : (pg * G + h) * 8) + part) : -1;
                    }
                    const int d = load_degree(a, 4);
                    if (now) after = d > after ? d : after;
                    else before = d > before ? d : before;
                }
        printf("  GQA %d: bias partials' stores degree %d -> %d\n", G, before, after);
        TH_CHECK(after == 1 && before == (2 * G < 8 ? 2 * G : 8), "GQA %d: bias partials' stores %d -> %d", G, before, after);
        TH_CHECK(kvq_bred_page(G) % 4 == 0, "GQA %d: a page's partials not 16-byte aligned", G);
    }
    /* the prologue's query copy (kvq_decode_body: kvq_q_copy_item), its four 4-byte stores an item; before, items
     * went channels first (32 lanes of one head) and stored in channel order */
    for (int G = 1; G <= 16; G *= 2)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int D = dims[di];
            int deg[2] = {0, 0}, seen_bad = 0;
            char hit[256 * 16] = {0};
            for (int now = 0; now < 2; now++)
                for (int i0 = 0; i0 < D * G / 4; i0 += 32)
                    for (int k = 0; k < 4; k++) {
                        long long a[32];
                        for (int l = 0; l < 32; l++) {
                            const int i = i0 + l;
                            int h = i / (D / 4), c = 4 * (i % (D / 4)), rot = 0;
                            if (now) kvq_q_copy_item(i, G, &h, &c, &rot);
                            const int ch = c + (now ? (k + rot) & 3 : k);
                            a[l] = i < D * G / 4 ? 4LL * (ch * G + h) : -1;
                            if (now && i < D * G / 4 && hit[ch * G + h]++) seen_bad++; /* each float once */
                        }
                        const int d = load_degree(a, 4);
                        deg[now] = d > deg[now] ? d : deg[now];
                    }
            if (D == 128) printf("  GQA %d, head_dim %d: the prologue's query stores degree %d -> %d\n", G, D, deg[0], deg[1]);
            TH_CHECK(deg[1] == 1 && deg[0] > 1 && seen_bad == 0, "GQA %d, head_dim %d: query stores %d -> %d (%d twice)",
                     G, D, deg[0], deg[1], seen_bad);
        }
    /* p.V's weight fragments (kvq_mma_put_w2 from kvq_probs: lane l stores the 32-bit pair of tokens 2l, 2l + 1 for
     * head h, part lo, group gi; kvq_values_mma: lane l loads 8 bytes at entry l of a block), 4 groups, 16 blocks:
     * blocks KVQ_MMA_WKS(4) = 264 words apart, groups 64 (before: [group][block], 64 words a block) */
    {
        int st_deg[2] = {0, 0}, ld_deg[2] = {0, 0};
        const int ngv = 4, nks = 16, wks = ngv * 64 + 8;
        for (int now = 0; now < 2; now++)
            for (int w = 0; w < 4; w++)
                for (int gi = 0; gi < ngv; gi++)
                    for (int h = 0; h < 4; h++)
                        for (int lo = 0; lo < 2; lo++) {
                            long long a[32];
                            for (int l = 0; l < 32; l++) {
                                const int t = (2 * (32 * w + l)) % (16 * nks), ks = t >> 4, k = t & 15;
                                const int in = ((k & 7) >> 1) * 2 + (k >> 3) + 16 * h + 8 * lo;
                                a[l] = 4LL * (now ? ks * wks + gi * 64 + in : (gi * nks + ks) * 64 + in);
                            }
                            const int d = load_degree(a, 4);
                            st_deg[now] = d > st_deg[now] ? d : st_deg[now];
                        }
        for (int now = 0; now < 2; now++)
            for (int ks = 0; ks < nks; ks++)
                for (int gi = 0; gi < ngv; gi++) {
                    long long a[32];
                    for (int l = 0; l < 32; l++)
                        a[l] = 4LL * ((now ? ks * wks + gi * 64 : (gi * nks + ks) * 64) + 2 * l);
                    const int d = load_degree(a, 8);
                    ld_deg[now] = d > ld_deg[now] ? d : ld_deg[now];
                }
        printf("  p.V's weights: stores degree %d -> %d, loads %d -> %d\n", st_deg[0], st_deg[1], ld_deg[0], ld_deg[1]);
        TH_CHECK(st_deg[1] == 1 && st_deg[0] == 4 && ld_deg[1] == 1, "weights: stores %d -> %d, loads %d -> %d",
                 st_deg[0], st_deg[1], ld_deg[0], ld_deg[1]);
    }
    /* the value parameters kvq_probs_pairs reads for a token pair (fp16 scales, then zeros, 4 groups): 16 bytes a
     * lane at a 16-byte stride (before: 2-byte loads, element 2 t ngv + gi + u ngv) */
    {
        int before = 0, after = 0;
        for (int w = 0; w < 4; w++) {
            long long a[32];
            for (int e = 0; e < 8; e++) {
                for (int l = 0; l < 32; l++) a[l] = 2LL * (8 * (32 * w + l) + e);
                const int d = load_degree(a, 2);
                before = d > before ? d : before;
            }
            for (int l = 0; l < 32; l++) a[l] = 16LL * (32 * w + l);
            const int d = load_degree(a, 16);
            after = d > after ? d : after;
        }
        printf("  value scales and zeros of a token pair: loads degree %d -> %d\n", before, after);
        TH_CHECK(after == 1 && before == 4, "value parameters: %d -> %d", before, after);
    }
    /* the probabilities' score loads at the tensor-core path's GQA 1, 2 and 4 (plan.c mma_shape_ok) */
    for (int G = 1; G <= 4; G *= 2) {
        int before = 0, after = 0;
        for (int w = 0; w < 4; w++) {
            long long a[32];
            for (int x = 0; x < 2 * G; x++) { /* before: one 4-byte load per score */
                for (int l = 0; l < 32; l++) a[l] = 4LL * (2 * (32 * w + l) * G + x);
                const int d = load_degree(a, 4);
                before = d > before ? d : before;
            }
            const int wb = G % 2 == 0 ? 16 : 8;
            for (int x = 0; x < 2 * G; x += wb / 4) {
                for (int l = 0; l < 32; l++) a[l] = 4LL * (2 * (32 * w + l) * G + x);
                const int d = load_degree(a, wb);
                after = d > after ? d : after;
            }
        }
        printf("  GQA %d: probabilities' score loads degree %d -> %d\n", G, before, after);
        TH_CHECK(after <= 2 && after < before, "GQA %d: score loads %d -> %d", G, before, after);
    }
    th_end();
}

/* kvq_scores' query loads: for each run of 8 channels at c0 a lane loads the query's rows [c][GQA] of the run at
 * qs + 4 c GQA: at GQA % 4 == 0 each row in 16-byte loads (kvq_ld_qrow), at GQA 1 and 2 the run's 8 GQA floats in
 * 16-byte loads; before, 4-byte loads at GQA 1 and 2 (a whole warp a phase). Before kvq_p1_lane a token's parts
 * were neighbouring lanes (part = tid mod split), whose rows D / split channels apart fell in one bank group:
 * 2-way at split 2 (the fp16 classes' 64-token tiles; ncu, H200 run 4: fp16's 38 % excess load wavefronts).
 * Returns the worst degree over the loop's query loads, the kernel now (1) or before (0). */
static int qrow_degree(int split, int D, int G, int now)
{
    const int cp = D / split, w = now || G % 4 == 0 ? 16 : 4;
    int worst = 0;
    for (int warp = 0; warp < 4; warp++)
        for (int j = 0; j < cp / 8; j++)
            for (int k = 0; k < 8 * G; k += w / 4) { /* the run's floats, load by load */
                long long a[32];
                for (int l = 0; l < 32; l++) {
                    const int tid = 32 * warp + l;
                    int part = tid % split, lane1;
                    if (now) kvq_p1_lane(tid, split, &part, &lane1);
                    a[l] = 4LL * ((part * cp + 8 * j) * G + k);
                }
                const int d = load_degree(a, w);
                worst = d > worst ? d : worst;
            }
    return worst;
}

static void test_score_query_rows(void)
{
    th_begin("fp32 score loop: the query rows conflict-free at every split the plan makes (fp16 classes 2-way before), "
             "and phase 1's lanes cover each token's parts once");
    static const int dims[] = {64, 96, 128, 256};
    for (int split = 1; split <= 2; split *= 2) /* T >= 32, 2 split T <= 128 threads: plan.c tile_mapping */
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (int G = 1; G <= 8; G *= 2) {
                const int D = dims[di];
                if (D % (16 * split)) continue; /* plan.c tile_mapping */
                const int before = qrow_degree(split, D, G, 0), after = qrow_degree(split, D, G, 1);
                if ((G == 4 || (G == 1 && split == 2)) && (D == 128 || split == 1))
                    printf("  split %d, head_dim %d, GQA %d: query loads degree %d -> %d\n", split, D, G, before, after);
                TH_CHECK(after == 1, "split %d, head_dim %d, GQA %d: query loads %d-way", split, D, G, after);
                if (split > 1 && D % 128 == 0)
                    TH_CHECK(before > 1, "split %d, head_dim %d, GQA %d: no conflict before (the check proves nothing)",
                             split, D, G);
            }
    /* the mapping is a bijection of the block's threads onto (token lane, part), THREADS / split token lanes */
    for (int split = 1; split <= 4; split *= 2) {
        int seen[128] = {0}, bad = 0;
        for (int tid = 0; tid < 128; tid++) {
            int part, lane1;
            kvq_p1_lane(tid, split, &part, &lane1);
            if (part < 0 || part >= split || lane1 < 0 || lane1 >= 128 / split || seen[lane1 * split + part]++) bad++;
            /* a token's parts lie in one warp, 8 lanes apart (the shuffles reduce over those offsets) */
            int p0, l0;
            kvq_p1_lane(tid ^ 8 * part, split, &p0, &l0);
            if (l0 != lane1 || p0 != 0) bad++;
        }
        TH_CHECK(bad == 0, "split %d: %d threads misplaced", split, bad);
    }
    th_end();
}

int main(void)
{
    test_swizzle_is_a_permutation();
    test_hot_loops();
    test_score_query_rows();
    test_query_fold();
    return th_summary();
}
