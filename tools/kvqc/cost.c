/* kvqc build --cost: the cost model (docs/cuda.md, "Cost model"). For a stated workload (batch, tokens), one
 * real decode step of the runtime runs under the emulator with the warp-level profile on (tests/emu/profile.c:
 * every basic block of the kernels, with its call stack, counted once per warp); the shipped translation unit is
 * compiled again with line information (the same SASS, checked), and each basic block of the decode kernels'
 * SASS gets the count of its source lines (compiler/sass_cost.c). Nothing about tiles, branches or trip counts
 * is assumed: they are those of the run. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "cost.h"
#include "cuda/cu.h"
#include "kvq.h"
#include "rt_internal.h"
#include "sass_cost.h"

#define PROF_OFFSETS 64 /* offsets a profile line holds at most (tests/emu/profile.c: PROF_DEPTH + 1) */

typedef struct {
    sass_loc *loc;
    double *count;
    int n, cap;
    /* per (location, call context): the most of the location's emulated blocks in that context (add_loc); a
     * location's count is their sum over contexts (sum_contexts) */
    sass_loc *ctx_loc;
    unsigned long long *ctx_key;
    double *ctx_count;
    int n_ctx, cap_ctx;
    unsigned char *bb_line; /* lines of the unit that start a basic block of the emulated code */
    int n_lines;
    unsigned long exit_site[16384]; /* offsets of the keys of function exit blocks (not counted) */
    int n_exit;
    struct {
        char kernel[64];
        char dim;
        unsigned n;
    } sample[64]; /* the sampled launches: one block of every n along dim ran (run_step) */
    int n_samples;
} profile_buf;

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *s = kvq_malloc(cap);
    while (s) {
        if (n + 4096 + 1 > cap) {
            char *t = kvq_realloc(s, cap *= 2);
            if (!t) {
                kvq_free(s);
                s = NULL;
                break;
            }
            s = t;
        }
        size_t r = fread(s + n, 1, 4096, f);
        n += r;
        if (r == 0) break;
    }
    fclose(f);
    if (s) s[n] = '\0';
    if (len) *len = n;
    return s;
}

static char *run_text(const char *cmd)
{
    FILE *f = popen(cmd, "r");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *s = kvq_malloc(cap);
    while (s) {
        if (n + 65536 + 1 > cap) {
            char *t = kvq_realloc(s, cap *= 2);
            if (!t) {
                kvq_free(s);
                s = NULL;
                break;
            }
            s = t;
        }
        size_t r = fread(s + n, 1, 65536, f);
        n += r;
        if (r == 0) break;
    }
    if (pclose(f) != 0 && s) {
        kvq_free(s);
        return NULL;
    }
    if (s) s[n] = '\0';
    return s;
}

/* The decode step: batch sequences of `tokens` prefilled tokens (layer 0), one kvq_decode step. Every sequence
 * gets the same rows, so the runtime gives every one the same pages, window and tiles; sequence 0 is prefilled
 * under the emulator, the others' prefill launches are skipped ($KVQ_EMU_SKIP: their host state, which decides
 * the step's tiles and split, is made all the same), and the step's decode and merge launches run only sequence
 * 0's blocks of head 0 (every head gets the same rows), each counted for the batch and the heads ($KVQ_EMU_SAMPLE,
 * set by the caller: the grid of kvq_decode_c<k> is (kv heads, chunks, batch), kvq_merge's (heads, batch),
 * cu_decode_launch). That this stands for the whole step is checked here (every sequence's tiles after the step,
 * rt_step_tiles, are sequence 0's), by the caller (the sampled dimensions are those) and by test_cost_model (the
 * same counts as a run of every block). */
static int run_step(const kvq_scheme *sch, const kvq_plan *p, int batch, int tokens, int every_block, char *msg,
                    size_t ms)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = KVQ_BACKEND_EMU;
    cfg.dtype = (kvq_dtype)p->in_dtype;
    cfg.dims.layers = p->layers, cfg.dims.heads = p->heads, cfg.dims.kv_heads = p->kv_heads;
    cfg.dims.head_dim = p->head_dim;
    kvq_engine *e = NULL;
    if (kvq_engine_create(sch, &cfg, &e, msg, ms) != KVQ_OK) return -1;
    const size_t es = cfg.dtype == KVQ_F32 ? 4 : 2, D = (size_t)p->head_dim;
    const size_t nkv = (size_t)p->kv_heads * tokens * D, nq = (size_t)p->heads * tokens * D;
    kvq_seq **seqs = kvq_calloc((size_t)batch, sizeof *seqs);
    unsigned char *k = kvq_malloc(nkv * es), *v = kvq_malloc(nkv * es), *q = kvq_malloc(nq * es);
    unsigned char *step = kvq_malloc((size_t)batch * (2 * p->kv_heads + p->heads) * D * es);
    float *out = kvq_malloc((size_t)batch * p->heads * D * sizeof *out);
    kvq_prefill_item *pi = kvq_calloc((size_t)batch, sizeof *pi);
    kvq_decode_item *di = kvq_calloc((size_t)batch, sizeof *di);
    kvq_tile_info *t0 = NULL, *tb = NULL;
    int rc = -1;
    if (!seqs || !k || !v || !q || !step || !out || !pi || !di) {
        snprintf(msg, ms, "out of memory");
        goto done;
    }
    /* values of unit scale from a fixed LCG, the same rows for every head (rows [heads][tokens][head_dim]): the
     * heads are alike too, and the step's decode and merge launches run head 0's blocks for all */
    uint32_t x = 12345;
    unsigned char *bufs[3] = {k, v, q};
    const size_t per_head = (size_t)tokens * D, heads[3] = {(size_t)p->kv_heads, (size_t)p->kv_heads, (size_t)p->heads};
    for (int b = 0; b < 3; b++) {
        for (size_t i = 0; i < per_head; i++) {
            x = x * 1664525u + 1013904223u;
            float f = ((float)(x >> 8) / 16777216.0f - 0.5f) * 2.0f;
            if (es == 4) memcpy(bufs[b] + 4 * i, &f, 4);
            else {
                unsigned short h = (unsigned short)(0x3c00 ^ (x & 0x83ff)); /* within +-2, finite */
                memcpy(bufs[b] + 2 * i, &h, 2);
            }
        }
        for (size_t h = 1; h < heads[b]; h++) memcpy(bufs[b] + h * per_head * es, bufs[b], per_head * es);
    }
    for (int b = 0; b < batch; b++) {
        if (kvq_seq_create(e, &seqs[b]) != KVQ_OK) {
            snprintf(msg, ms, "%s", kvq_engine_errmsg(e));
            goto done;
        }
        pi[b] = (kvq_prefill_item){seqs[b], tokens, k, v, q};
    }
    kvq_status pst = kvq_prefill(e, 0, pi, every_block ? batch : 1);
    if (pst == KVQ_OK && batch > 1 && !every_block) {
        /* without queries where the layer takes none (checking 31 x 32k tokens of queries costs more than the
         * step): the runtime refuses up front when it needs them, and then gets them */
        setenv("KVQ_EMU_SKIP", "1", 1);
        for (int b = 1; b < batch; b++) pi[b].q = NULL;
        pst = kvq_prefill(e, 0, pi + 1, batch - 1);
        if (pst == KVQ_ERR_INVALID) {
            for (int b = 1; b < batch; b++) pi[b].q = q;
            pst = kvq_prefill(e, 0, pi + 1, batch - 1);
        }
        unsetenv("KVQ_EMU_SKIP");
    }
    if (pst != KVQ_OK) {
        snprintf(msg, ms, "prefill: %s", kvq_engine_errmsg(e));
        goto done;
    }
    for (int b = 0; b < batch; b++) { /* the new token: each head's first prefilled row, alike across heads */
        unsigned char *s = step + (size_t)b * (2 * p->kv_heads + p->heads) * D * es;
        for (int h = 0; h < p->kv_heads; h++) {
            memcpy(s + (size_t)h * D * es, k + (size_t)h * per_head * es, D * es);
            memcpy(s + (size_t)(p->kv_heads + h) * D * es, v + (size_t)h * per_head * es, D * es);
        }
        for (int h = 0; h < p->heads; h++)
            memcpy(s + (size_t)(2 * p->kv_heads + h) * D * es, q + (size_t)h * per_head * es, D * es);
        di[b] = (kvq_decode_item){seqs[b], s, s + (size_t)p->kv_heads * D * es, s + (size_t)2 * p->kv_heads * D * es,
                                  out + (size_t)b * p->heads * D};
    }
    if (kvq_decode(e, 0, di, batch) != KVQ_OK) {
        snprintf(msg, ms, "decode: %s", kvq_engine_errmsg(e));
        goto done;
    }
    /* the blocks of sequence 0 stand for every sequence's: the same tiles */
    int n0 = 0, nb = 0;
    if (rt_step_tiles(e, seqs[0], 0, NULL, 0, &n0) != KVQ_OK || !(t0 = kvq_calloc((size_t)n0 + 1, sizeof *t0)) ||
        !(tb = kvq_calloc((size_t)n0 + 1, sizeof *tb)) || rt_step_tiles(e, seqs[0], 0, t0, n0, &n0) != KVQ_OK) {
        snprintf(msg, ms, "the step's tiles: %s", kvq_engine_errmsg(e));
        goto done;
    }
    if (getenv("KVQ_COST_DEBUG")) /* the tile list, for hand counts (docs/cuda.md, "Cost model") */
        for (int i = 0; i < n0; i++)
            fprintf(stderr, "tile %d: %d tokens, key kind %d, value kind %d, %d key pages\n", i, t0[i].n, t0[i].k_kind,
                    t0[i].v_kind, t0[i].k_pages);
    for (int b = 1; b < batch; b++) {
        if (rt_step_tiles(e, seqs[b], 0, tb, n0, &nb) != KVQ_OK) {
            snprintf(msg, ms, "the step's tiles: %s", kvq_engine_errmsg(e));
            goto done;
        }
        int same = nb == n0;
        for (int i = 0; i < n0 && same; i++)
            same = tb[i].n == t0[i].n && tb[i].k_kind == t0[i].k_kind && tb[i].v_kind == t0[i].v_kind &&
                   tb[i].k_pages == t0[i].k_pages;
        if (!same) {
            snprintf(msg, ms, "sequence %d's tiles differ from sequence 0's: the sampled step does not stand for the batch",
                     b);
            goto done;
        }
    }
    rc = 0;
done:
    kvq_engine_free(e); /* unloads the module: the profile is written */
    kvq_free(seqs);
    kvq_free(k);
    kvq_free(v);
    kvq_free(q);
    kvq_free(step);
    kvq_free(out);
    kvq_free(pi);
    kvq_free(di);
    kvq_free(t0);
    kvq_free(tb);
    return rc;
}

/* One emulated block's warp count under its location and call context (`ctx`: a hash of the call sites' offsets
 * in the module). Within one context a line split into several emulated blocks (a `for` line's condition and
 * increment) runs once per execution in each of them: the most. Different contexts of the same location are
 * different calls from one source line (a macro such as KVQ_BY_KIND calls one function from each of its branches,
 * all on the macro's line): alternatives, each execution in one of them, so sum_contexts adds them. Taking the
 * most over contexts (before issue 22's H200 check) gave every SASS copy of such a call the count of the
 * busiest branch. */
static int add_loc(profile_buf *pb, const sass_loc *l, unsigned long long ctx, double c)
{
    for (int i = 0; i < pb->n_ctx; i++)
        if (pb->ctx_key[i] == ctx && pb->ctx_loc[i].depth == l->depth &&
            !memcmp(pb->ctx_loc[i].line, l->line, (size_t)l->depth * sizeof l->line[0])) {
            if (c > pb->ctx_count[i]) pb->ctx_count[i] = c;
            return 0;
        }
    if (pb->n_ctx == pb->cap_ctx) {
        int nc = pb->cap_ctx ? 2 * pb->cap_ctx : 1024;
        sass_loc *a = kvq_realloc(pb->ctx_loc, (size_t)nc * sizeof *a);
        if (!a) return -1;
        pb->ctx_loc = a;
        unsigned long long *k = kvq_realloc(pb->ctx_key, (size_t)nc * sizeof *k);
        if (!k) return -1;
        pb->ctx_key = k;
        double *d = kvq_realloc(pb->ctx_count, (size_t)nc * sizeof *d);
        if (!d) return -1;
        pb->ctx_count = d;
        pb->cap_ctx = nc;
    }
    pb->ctx_loc[pb->n_ctx] = *l;
    pb->ctx_key[pb->n_ctx] = ctx;
    pb->ctx_count[pb->n_ctx++] = c;
    return 0;
}

/* Each location's count: the sum over its call contexts (add_loc). */
static int sum_contexts(profile_buf *pb)
{
    for (int j = 0; j < pb->n_ctx; j++) {
        const sass_loc *l = &pb->ctx_loc[j];
        int i = 0;
        while (i < pb->n && !(pb->loc[i].depth == l->depth &&
                              !memcmp(pb->loc[i].line, l->line, (size_t)l->depth * sizeof l->line[0])))
            i++;
        if (i == pb->n) {
            if (pb->n == pb->cap) {
                int nc = pb->cap ? 2 * pb->cap : 1024;
                sass_loc *a = kvq_realloc(pb->loc, (size_t)nc * sizeof *a);
                if (!a) return -1;
                pb->loc = a;
                double *d = kvq_realloc(pb->count, (size_t)nc * sizeof *d);
                if (!d) return -1;
                pb->count = d;
                pb->cap = nc;
            }
            pb->loc[pb->n] = *l;
            pb->count[pb->n++] = 0.0;
        }
        pb->count[i] += pb->ctx_count[j];
    }
    return 0;
}

/* The profile file -> locations of the translation unit (lines of the module's .emu.cu, which must be `src`). */
static int read_profile(const char *path, const char *src, profile_buf *pb, char *msg, size_t ms)
{
    char *text = slurp(path, NULL);
    if (!text) {
        snprintf(msg, ms, "no profile written to %s", path);
        return -1;
    }
    /* the last module written holds the decode kernels (the step's module) */
    char *m = NULL;
    for (char *s = strstr(text, "module "); s; s = strstr(s + 1, "\nmodule ")) m = s[0] == '\n' ? s + 1 : s;
    char so[PATH_MAX], state[32];
    if (!m || sscanf(m, "module %4095s %31s", so, state) != 2 || strcmp(state, "complete")) {
        snprintf(msg, ms, "the emulator's profile is missing or incomplete (%s)", path);
        kvq_free(text);
        return -1;
    }
    char cu[PATH_MAX];
    snprintf(cu, sizeof cu, "%.*s.cu", (int)(strlen(so) - 3), so);
    if (access(so, R_OK) != 0) {
        snprintf(msg, ms, "the profiled module %s is gone", so);
        kvq_free(text);
        return -1;
    }
    char *tu = slurp(cu, NULL);
    int same = tu && !strcmp(tu, src);
    kvq_free(tu);
    if (!same) {
        snprintf(msg, ms, "the emulated translation unit %s differs from the one built", cu);
        kvq_free(text);
        return -1;
    }
    /* the block and call-site offsets, symbolised by addr2line in one run */
    char tmp[] = "/tmp/kvq_cost_XXXXXX";
    int fd = mkstemp(tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        snprintf(msg, ms, "cannot write a temporary file");
        kvq_free(text);
        return -1;
    }
    int n_off = 0;
    char *body = strchr(m, '\n');
    for (char *l = body ? body + 1 : NULL; l && *l && strncmp(l, "module ", 7); l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
        unsigned long long cnt;
        int depth, used;
        char kname[64], dim;
        unsigned along;
        if (sscanf(l, "sample %63s %c %u", kname, &dim, &along) == 3) {
            if (pb->n_samples < (int)(sizeof pb->sample / sizeof pb->sample[0])) {
                snprintf(pb->sample[pb->n_samples].kernel, sizeof pb->sample[0].kernel, "%s", kname);
                pb->sample[pb->n_samples].dim = dim, pb->sample[pb->n_samples].n = along;
            }
            pb->n_samples++;
            continue;
        }
        if (sscanf(l, "%llu %d%n", &cnt, &depth, &used) != 2) break;
        char *p = l + used;
        for (int i = 0; i < depth; i++) {
            unsigned long off = strtoul(p, &p, 16);
            fprintf(f, "%lx\n", off);
            n_off++;
        }
    }
    fclose(f);
    char cmd[PATH_MAX * 2 + 64];
    snprintf(cmd, sizeof cmd, "addr2line -e '%s' < '%s'", so, tmp);
    char *sym = run_text(cmd);
    unlink(tmp);
    if (!sym) {
        snprintf(msg, ms, "addr2line failed on %s (binutils)", so);
        kvq_free(text);
        return -1;
    }
    /* every basic block's line, run or not: the trace calls in the module's code */
    {
        int n_lines = 1;
        for (const char *c = src; *c; c++) n_lines += *c == '\n';
        pb->bb_line = kvq_calloc((size_t)n_lines + 1, 1);
        pb->n_lines = n_lines + 1;
        /* the trace calls, each with 1 when its block is a function's exit block (it calls the exit hook before
         * the next trace call): gcc gives that block the line of the function's last statement, which it does
         * not execute (a loop in an untaken else branch would seem to run once a call), so exit blocks are not
         * counted and their lines say nothing */
        snprintf(cmd, sizeof cmd,
                 "objdump -d --no-show-raw-insn '%s' | awk '/call.*<__sanitizer_cov_trace_pc/{if (p != \"\") print p, 0; "
                 "sub(\":\",\"\",$1); p = $1} /call.*<__cyg_profile_func_exit/{if (p != \"\") print p, 1; p = \"\"} "
                 "END{if (p != \"\") print p, 0}'",
                 so);
        char *sites = pb->bb_line ? run_text(cmd) : NULL;
        char stmp[] = "/tmp/kvq_cost_sites_XXXXXX";
        int sfd = sites ? mkstemp(stmp) : -1;
        FILE *sf = sfd >= 0 ? fdopen(sfd, "w") : NULL;
        int n_sites = 0;
        for (char *l = sites; sf && l && *l; n_sites++) {
            char *e = strchr(l, '\n');
            unsigned long addr = strtoul(l, NULL, 16);
            int exit_blk = e && e > l && e[-1] == '1';
            fprintf(sf, "%lx\n", addr);
            if (exit_blk && pb->n_exit < (int)(sizeof pb->exit_site / sizeof pb->exit_site[0]))
                pb->exit_site[pb->n_exit++] = addr + 4; /* the key's offset: in the 5-byte call */
            l = e ? e + 1 : NULL;
        }
        if (sf) fclose(sf);
        char *bbs = NULL;
        if (sf) {
            snprintf(cmd, sizeof cmd, "addr2line -e '%s' < '%s'", so, stmp);
            bbs = run_text(cmd);
            unlink(stmp);
        }
        int site = 0;
        for (char *l = bbs, *sl = sites; l && *l; site++) {
            char *e = strchr(l, '\n');
            if (e) *e = '\0';
            char *se = sl ? strchr(sl, '\n') : NULL;
            int exit_blk = se && se > sl && se[-1] == '1';
            sl = se ? se + 1 : NULL;
            char *d = strstr(l, " (discriminator");
            if (d) *d = '\0';
            char *colon = strrchr(l, ':');
            if (!exit_blk && colon && (size_t)(colon - l) == strlen(cu) && !strncmp(l, cu, strlen(cu))) {
                int line = atoi(colon + 1);
                if (line > 0 && line < pb->n_lines) pb->bb_line[line] = 1;
            }
            l = e ? e + 1 : NULL;
        }
        (void)n_sites;
        kvq_free(sites);
        kvq_free(bbs);
        /* 2: lines without a condition of their own; 3: lines whose condition is an if's or a ?:'s */
        int line = 1;
        for (const char *c = src; *c && pb->bb_line; line++) {
            const char *e = strchr(c, '\n');
            size_t len = e ? (size_t)(e - c) : strlen(c);
            char text[512];
            snprintf(text, sizeof text, "%.*s", (int)(len < sizeof text ? len : sizeof text - 1), c);
            if (line < pb->n_lines && pb->bb_line[line] && !strstr(text, "if (") && !strchr(text, '?') &&
                !strstr(text, "for (") && !strstr(text, "while") && !strstr(text, "&&") && !strstr(text, "||") &&
                !strstr(text, "KVQ_BY_KIND") && !strstr(text, "#"))
                pb->bb_line[line] = 2;
            else if (line < pb->n_lines && pb->bb_line[line] && (strstr(text, "if (") || strchr(text, '?')) &&
                     !strstr(text, "for (") && !strstr(text, "while"))
                pb->bb_line[line] = 3; /* a branch's condition, no loop's */
            c = e ? e + 1 : c + len;
        }
    }
    char *sp = sym;
    int rc = 0;
    for (char *l = body ? body + 1 : NULL; l && *l && strncmp(l, "module ", 7) && !rc;
         l = strchr(l, '\n'), l = l ? l + 1 : NULL) {
        unsigned long long cnt;
        int depth, used;
        if (!strncmp(l, "sample ", 7)) continue;
        if (sscanf(l, "%llu %d%n", &cnt, &depth, &used) != 2) break;
        sass_loc loc = {{0}, 0};
        int exit_blk = 0;
        /* the location's call context: the call sites above the frame that gives the location its line (the
         * chain's first offset in the unit; a block of the emulator's headers counts under the line that calls
         * it, in that line's context), hashed (FNV-1a) */
        unsigned long long ctx = 1469598103934665603ull;
        unsigned long off[PROF_OFFSETS];
        {
            char *o = l + used;
            for (int i = 0; i < depth && i < PROF_OFFSETS; i++) off[i] = strtoul(o, &o, 16);
            for (int i = 0; i < pb->n_exit && !exit_blk; i++) exit_blk = pb->exit_site[i] == off[0];
        }
        for (int i = 0; i < depth; i++) {
            char *e = strchr(sp, '\n');
            if (!e) break;
            *e = '\0';
            /* "<dir>/<key>.emu.cu:123" (maybe " (discriminator 2)"); other files: the emulator's headers */
            char *colon = strrchr(sp, ':');
            int in_tu = colon && (size_t)(colon - sp) == strlen(cu) && !strncmp(sp, cu, strlen(cu));
            if (!colon) {
                char *d = strstr(sp, " (discriminator");
                if (d) *d = '\0';
                colon = strrchr(sp, ':');
                in_tu = colon && (size_t)(colon - sp) == strlen(cu) && !strncmp(sp, cu, strlen(cu));
            }
            if (in_tu && loc.depth > 0 && i < PROF_OFFSETS)
                for (int b = 0; b < 8; b++) ctx = (ctx ^ ((off[i] >> (8 * b)) & 0xff)) * 1099511628211ull;
            if (in_tu && loc.depth < SASS_LOC_DEPTH) {
                int line = atoi(colon + 1);
                if (line > 0) loc.line[loc.depth++] = line;
            }
            sp = e + 1;
        }
        /* the outermost call is the emulator's entry thunk calling the kernel (KVQ_KERNEL_EXPORT's line): the
         * GPU's chains start in the kernel */
        loc.depth--;
        if (loc.depth > 0 && !exit_blk) rc = add_loc(pb, &loc, ctx, (double)cnt);
    }
    if (!rc) rc = sum_contexts(pb);
    kvq_free(sym);
    kvq_free(text);
    if (rc) snprintf(msg, ms, "out of memory");
    return rc;
}

/* The instruction lines of nvdisasm's text (no line comments, labels or headers), for the identity check */
static char *code_only(const char *s)
{
    size_t n = strlen(s), k = 0;
    char *o = kvq_malloc(n + 1);
    if (!o) return NULL;
    while (*s) {
        const char *e = strchr(s, '\n');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        const char *p = s;
        while (p < s + len && (*p == ' ' || *p == '\t')) p++;
        if (!strncmp(p, "/*", 2)) {
            memcpy(o + k, s, len);
            k += len;
            o[k++] = '\n';
        }
        s += len + (e ? 1 : 0);
    }
    o[k] = '\0';
    return o;
}

/* The line of `needle` in `src` (1-based), 0 when absent. */
static int line_of(const char *src, const char *needle)
{
    const char *s = strstr(src, needle);
    if (!s) return 0;
    int line = 1;
    for (const char *p = src; p < s; p++) line += *p == '\n';
    return line;
}

/* CTAs per SM from the kernel's registers, threads and shared memory (CUDA occupancy rules; registers allocated
 * per warp in units of 256, shared memory with 1 KiB reserved per CTA). */
int kvqc_cost(const kvqc_cost_args *a, const kvq_scheme *sch, const kvq_plan *p, const char *dir, const char *src,
              const char *arch, const char *nvdisasm, emit_buf *out)
{
    char msg[1024], path[PATH_MAX + 64];
    int rc = -1;
    cu_compiled c;
    char *diag = NULL, *sass = NULL, *shipped = NULL;
    profile_buf pb = {0};
    unsigned char *rolled = NULL;
    memset(&c, 0, sizeof c);
    /* 1. the shipped unit with line information: the same instructions as the shipped cubin */
    if (cu_nvrtc_compile_lineinfo(src, arch, 1, &c, &diag, msg, sizeof msg) != KVQ_OK) {
        fprintf(stderr, "kvqc build: cost model: %s\n", msg);
        kvq_free(diag);
        return -1;
    }
    char name[64];
    snprintf(name, sizeof name, "%s-lineinfo.cubin", arch);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(c.cubin, 1, c.cubin_size, f) != c.cubin_size) {
        if (f) fclose(f);
        fprintf(stderr, "kvqc build: cannot write %s\n", path);
        goto done;
    }
    fclose(f);
    char cmd[3 * PATH_MAX];
    snprintf(cmd, sizeof cmd, "'%s' -gi -c '%s' 2>/dev/null", nvdisasm, path);
    sass = run_text(cmd);
    snprintf(cmd, sizeof cmd, "'%s' -c '%s/%s.cubin' 2>/dev/null", nvdisasm, dir, arch);
    shipped = run_text(cmd);
    if (!sass || !shipped) {
        fprintf(stderr, "kvqc build: cost model: nvdisasm failed on %s\n", path);
        goto done;
    }
    {
        char *x = code_only(sass), *y = code_only(shipped);
        int same = x && y && !strcmp(x, y);
        kvq_free(x);
        kvq_free(y);
        if (!same) {
            fprintf(stderr, "kvqc build: cost model: the -lineinfo cubin's instructions differ from %s/%s.cubin\n", dir,
                    arch);
            goto done;
        }
    }
    /* 2. the real step under the emulator, the split sized for the arch's SMs */
    const int sm = atoi(arch + 3), sms = sm >= 90 ? 132 : 108;
    /* the profile is kept beside the outputs (<arch>-b<B>-t<T>.profile) and read again while the emulated module
     * it names is in the JIT cache and holds the same unit: the run takes minutes, the mapping a second */
    char prof[PATH_MAX + 96];
    snprintf(prof, sizeof prof, "%s/%s-b%d-t%d%s.profile", dir, arch, a->batch, a->tokens, a->every_block ? "-all" : "");
    if (read_profile(prof, src, &pb, msg, sizeof msg) != 0) {
        kvq_free(pb.loc);
        kvq_free(pb.count);
        kvq_free(pb.bb_line);
        kvq_free(pb.ctx_loc);
        kvq_free(pb.ctx_key);
        kvq_free(pb.ctx_count);
        memset(&pb, 0, sizeof pb);
        unlink(prof);
        char sms_s[16];
        snprintf(sms_s, sizeof sms_s, "%d", sms);
        setenv("KVQ_EMU_PROFILE", prof, 1);
        setenv("KVQ_EMU_SMS", sms_s, 1);
        setenv("KVQ_EMU_ARCH", sm >= 90 ? "sm_90" : "sm_80", 1);
        /* only the kernels counted are profiled; no sanitizers (the count needs none, and they slow the -O0 unit) */
        setenv("KVQ_EMU_PROFILE_KERNELS", "kvq_decode_c,kvq_merge", 1);
        setenv("KVQ_EMU_SANITIZE", "0", 1);
        if (!a->every_block) setenv("KVQ_EMU_SAMPLE", "kvq_decode_c:xz,kvq_merge:xy", 1);
        int st = run_step(sch, p, a->batch, a->tokens, a->every_block, msg, sizeof msg);
        unsetenv("KVQ_EMU_PROFILE");
        unsetenv("KVQ_EMU_SMS");
        unsetenv("KVQ_EMU_ARCH");
        unsetenv("KVQ_EMU_PROFILE_KERNELS");
        unsetenv("KVQ_EMU_SANITIZE");
        unsetenv("KVQ_EMU_SAMPLE");
        if (st != 0) {
            fprintf(stderr, "kvqc build: cost model: emulated step: %s\n", msg);
            goto done;
        }
        if (read_profile(prof, src, &pb, msg, sizeof msg) != 0) {
            fprintf(stderr, "kvqc build: cost model: %s\n", msg);
            goto done;
        }
    }
    /* the sampled launches were along the heads and the batch (cu_decode_launch): the decode kernels' grid is
     * (kv heads, chunks, batch), the merge's (heads, batch) */
    for (int i = 0; i < pb.n_samples; i++) {
        const int dec = !strncmp(pb.sample[i].kernel, "kvq_decode_c", 12), mrg = !strcmp(pb.sample[i].kernel, "kvq_merge");
        const char d = pb.sample[i].dim;
        const int want = d == 'x' ? (dec ? p->kv_heads : p->heads) : d == (dec ? 'z' : 'y') ? a->batch : -1;
        if (a->every_block || (!dec && !mrg) || want < 0 || pb.sample[i].n != (unsigned)want) {
            fprintf(stderr, "kvqc build: cost model: a sampled launch of %s along %c of %u blocks, not the %s's %d\n",
                    pb.sample[i].kernel, d, pb.sample[i].n, d == 'x' ? "heads" : "batch", want);
            goto done;
        }
    }
    /* lines of loops under `#pragma unroll 1` */
    rolled = kvq_calloc((size_t)pb.n_lines + 1, 1);
    if (!rolled) goto done;
    {
        int line = 1, prev_pragma = 0;
        for (const char *c = src; *c && line < pb.n_lines;) {
            const char *e = strchr(c, '\n');
            size_t len = e ? (size_t)(e - c) : strlen(c);
            const char *t = c;
            while (t < c + len && (*t == ' ' || *t == '\t')) t++;
            int is_for = !strncmp(t, "for (", 5);
            if (is_for && prev_pragma) rolled[line] = 1;
            if (t < c + len) prev_pragma = !strncmp(t, "#pragma unroll 1", 16) && (t[16] == '\0' || t[16] == ' ' || t[16] == '\n');
            line++;
            c = e ? e + 1 : c + len;
        }
    }
    sass_profile sp = {pb.loc, pb.count, pb.n, pb.bb_line, pb.n_lines, rolled};
    if (getenv("KVQ_COST_DEBUG"))
        for (int i = 0; i < pb.n; i++) {
            fprintf(stderr, "loc %.0f:", pb.count[i]);
            for (int j = 0; j < pb.loc[i].depth; j++) fprintf(stderr, " %d", pb.loc[i].line[j]);
            fprintf(stderr, "\n");
        }
    /* tiles the step ran: the tile loop's first statement, once a warp a tile */
    const int tile_line = line_of(src, "const kvq_tile T = ((const kvq_tile *)st.tiles)[ti];");
    const int warps = p->threads / 32;
    const double toks = (double)a->batch * p->kv_heads * (a->tokens + 1);
    for (int k = 0; k < p->n_classes; k++) {
        const plan_class *pc = &p->cls[k];
        char fn[64];
        snprintf(fn, sizeof fn, "kvq_decode_c%d", k);
        sass_cost sc, mc;
        int r = sass_cost_function(sass, fn, &sp, &sc);
        if (r < 0) goto done;
        if (r || sc.executed <= 0) {
            emit_buf_printf(out, "%-16s %-6s not run by the step (layer 0 is of another class)\n", fn, arch);
            continue;
        }
        memset(&mc, 0, sizeof mc);
        if (sass_cost_function(sass, "kvq_merge", &sp, &mc) < 0) goto done;
        double tiles = 0.0;
        for (int i = 0; i < pb.n && tile_line; i++)
            if (pb.loc[i].line[0] == tile_line) tiles += pb.count[i] / warps;
        int regs = 0;
        for (int i = 0; i < c.n_res; i++)
            if (!strcmp(c.res[i].name, fn)) regs = c.res[i].regs;
        const double bytes = plan_body_bytes_per_token(p, pc), per_tok = sc.executed / toks;
        const double tile_tok = tiles > 0 ? toks / tiles : 0.0;
        const int ctas = plan_decode_ctas_per_sm(p, pc, sm, regs);
        /* in flight: the plan's stages of tiles of the step's mean length a CTA, times its CTAs (plan.h) */
        const double inflight = plan_decode_bytes_in_flight(p, pc, sm, regs, tile_tok);
        /* issue 22's targets (docs/cuda.md, "Cost model"): warp-instructions per byte at most 0.2 for fp16 rows,
         * 0.35 for quantized ones at GQA 4 or more, 0.5 at GQA 1; at least 24 KiB in flight per SM on sm_90 */
        const int gqa = p->heads / p->kv_heads, f16 = pc->k_hi.bits == 16 && pc->v_hi.bits == 16;
        const double target = f16 ? 0.2 : gqa >= 4 ? 0.35 : gqa == 1 ? 0.5 : 0.0;
        char tgt[16] = "-", fl[16] = "-";
        /* "near": under the bound, but not by the model's margin against the machine (SASS_COST_MARGIN) */
        if (target > 0)
            snprintf(tgt, sizeof tgt, "%.2f:%s", target,
                     per_tok / bytes > target                      ? "FAIL"
                     : per_tok / bytes * SASS_COST_MARGIN > target ? "near"
                                                                   : "pass");
        if (sm >= 90) snprintf(fl, sizeof fl, "%s", inflight >= 24576 ? "pass" : "FAIL");
        emit_buf_printf(out,
                        "%-16s %-6s %5d %3d %6d %9.1f %7.2f %8.3f %-9s %5d %7d %4d %9.0f %-4s %9.1f %9.1f %6.1f %12.0f "
                        "%3.0f%% %8.1f\n",
                        fn, arch, a->batch, gqa, a->tokens, per_tok, bytes, per_tok / bytes, tgt, regs, pc->smem, ctas,
                        inflight, fl, tiles / ((double)a->batch * p->kv_heads), tile_tok, mc.executed / toks,
                        sc.executed, sc.instructions ? 100.0 * sc.instr_unknown / sc.instructions : 0.0,
                        sc.instr_run * 16 / 1024.0);
    }
    rc = out->failed ? -1 : 0;
done:
    cu_compiled_free(&c);
    kvq_free(sass);
    kvq_free(shipped);
    kvq_free(pb.loc);
    kvq_free(pb.count);
    kvq_free(pb.bb_line);
    kvq_free(pb.ctx_loc);
    kvq_free(pb.ctx_key);
    kvq_free(pb.ctx_count);
    kvq_free(rolled);
    return rc;
}

void kvqc_cost_header(const kvqc_cost_args *a, emit_buf *out)
{
    emit_buf_printf(out,
                    "# Cost model (docs/cuda.md, \"Cost model\"): warp-instructions a real decode step executes, counted\n"
                    "# under the emulator and mapped onto the shipped cubin's SASS by line; %d tokens + 1 a sequence.\n"
                    "# per_token: per token of one kv head; target: issue 22's per-byte bound and whether the row meets it\n"
                    "# (fp16 0.2, quantized 0.35 at GQA >= 4, 0.5 at GQA 1; near: met, but by less than the model's margin\n"
                    "# against the GPU, which counted up to 40 %% more); inflight: cache bytes in flight per SM, fl: at\n"
                    "# least 24 KiB (sm_90); tiles, tile_tok: tiles per (sequence, kv head) and their mean tokens; merge:\n"
                    "# kvq_merge per token; unknown: SASS of lines the profile did not place; code_kib: the code the step\n"
                    "# runs (its blocks counted run, 16 bytes an instruction), cold in a chunk of few tiles\n",
                    a->tokens);
    emit_buf_printf(out, "%-16s %-6s %5s %3s %6s %9s %7s %8s %-9s %5s %7s %4s %9s %-4s %9s %9s %6s %12s %4s %8s\n", "kernel",
                    "arch", "batch", "gqa", "tokens", "per_token", "bytes", "per_byte", "target", "regs", "smem", "ctas",
                    "inflight", "fl", "tiles", "tile_tok", "merge", "executed", "unknown", "code_kib");
}
