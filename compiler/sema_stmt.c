/* The statements of the .kvq language: where each may appear, its arguments, and what it sets. The table
 * DEFS is the single list of keywords; docs/language.md documents each. */
#include <stdio.h>
#include <string.h>

#include "sema_int.h"

static const char *block_name(unsigned kind)
{
    switch (kind) {
    case B_SCHEME: return "a scheme";
    case B_LAYERS: return "a layers block";
    case B_WHEN_Q: return "a 'when quantize' block";
    case B_WHEN_S: return "a 'when sparse' block";
    case B_KEY: return "a key block";
    case B_VALUE: return "a value block";
    case B_OUTLIERS: return "an outliers block";
    case B_SALIENCY: return "a saliency block";
    case B_CLASSIFY: return "a classify block";
    default: return "a model block";
    }
}

typedef struct stmt_def stmt_def;
typedef void (*stmt_fn)(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d);
enum { NO_BLOCK, NEEDS_BLOCK, MAY_BLOCK };
struct stmt_def {
    const char *name;
    unsigned where;
    stmt_fn fn;
    int block;
    int min_args, max_args;
    const char *usage;
    int repeatable; /* may appear several times in one block (layers) */
};

/* ---------------------------------------------------------------------------------------------------------- */
/* Arguments */

static const ast_arg *arg(const ast_stmt *st, int i)
{
    const ast_arg *a = st->args;
    while (a && i-- > 0) a = a->next;
    return a;
}

/* A whole number in [lo, hi]; what_lo/what_hi override the out-of-range messages. */
static int int_arg(sema_state *S, const ast_stmt *st, const ast_arg *a, int lo, int hi, int *out)
{
    char b1[64], b2[64];
    if (a->bad) return 0;
    if (a->kind == AST_REAL) {
        ERR(a->loc, "%s must be a whole number, not '%s'", sema_q(b1, sizeof b1, st->name),
            sema_q(b2, sizeof b2, a->text));
        return 0;
    }
    if (a->kind != AST_INT) {
        ERR(a->loc, "expected a number after '%s', found '%s'", sema_q(b1, sizeof b1, st->name),
            sema_q(b2, sizeof b2, a->text));
        return 0;
    }
    if (a->num < lo) {
        if (lo == 0)
            ERR(a->loc, "%s must not be negative, not '%s'", sema_q(b1, sizeof b1, st->name),
                sema_q(b2, sizeof b2, a->text));
        else
            ERR(a->loc, "%s must be at least %d, not '%s'", sema_q(b1, sizeof b1, st->name), lo,
                sema_q(b2, sizeof b2, a->text));
        return 0;
    }
    if (a->num > hi) {
        ERR(a->loc, "%s '%s' is too large (at most %d)", sema_q(b1, sizeof b1, st->name),
            sema_q(b2, sizeof b2, a->text), hi);
        return 0;
    }
    *out = (int)a->num;
    return 1;
}

/* A percentage 0%..100%, returned as a fraction. */
static int pct_arg(sema_state *S, const char *what, const ast_arg *a, double *out)
{
    char b1[64], b2[64];
    if (a->bad) return 0;
    if (a->kind != AST_PERCENT) {
        ERR(a->loc, "expected a percentage like '5%%' for %s, found '%s'", what, sema_q(b2, sizeof b2, a->text));
        return 0;
    }
    if (a->num < 0 || a->num > 100) {
        ERR(a->loc, "percentage '%s' is out of range (0%% to 100%%)", sema_q(b1, sizeof b1, a->text));
        return 0;
    }
    *out = a->num / 100.0;
    return 1;
}

/* One of the words in `choices` ("a|b|c"); returns its index or -1. */
static int choice_arg(sema_state *S, const ast_stmt *st, const ast_arg *a, const char *choices)
{
    char b1[64], b2[64], list[160];
    int idx = 0;
    size_t len = 0;
    const char *c = choices;
    if (a->kind == AST_IDENT) {
        while (*c) {
            const char *e = strchr(c, '|');
            size_t n = e ? (size_t)(e - c) : strlen(c);
            if (strlen(a->text) == n && memcmp(a->text, c, n) == 0) return idx;
            idx++;
            c += n + (e ? 1 : 0);
        }
    }
    /* "'channel' or 'token'", "'kivi', 'group' or ..." */
    list[0] = '\0';
    c = choices;
    for (int i = 0; *c; i++) {
        const char *e = strchr(c, '|');
        size_t n = e ? (size_t)(e - c) : strlen(c);
        int k = snprintf(list + len, sizeof list - len, "%s'%.*s'", i == 0 ? "" : (e ? ", " : " or "), (int)n, c);
        if (k > 0 && (size_t)k < sizeof list - len) len += (size_t)k;
        c += n + (e ? 1 : 0);
    }
    ERR(a->loc, "%s must be %s, not '%s'", sema_q(b1, sizeof b1, st->name), list, sema_q(b2, sizeof b2, a->text));
    return -1;
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Statements: tensors */

static void h_bits(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    const ast_arg *a = arg(st, 0);
    char b[64];
    (void)d;
    if (a->kind == AST_INT &&
        (a->num == 1 || a->num == 2 || a->num == 3 || a->num == 4 || a->num == 8 || a->num == 16)) {
        sema_put_tensor(S, c, T_BITS, a->num, st->loc);
        return;
    }
    ERR(a->loc, "bits must be 1, 2, 3, 4, 8 or 16, not '%s'", sema_q(b, sizeof b, a->text));
}

static void h_per(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = choice_arg(S, st, arg(st, 0), "channel|token");
    (void)d;
    if (k >= 0) sema_put_tensor(S, c, T_GRAN, k, st->loc);
}

static void h_cs(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = 0;
    (void)d;
    /* `channel_separable;` or `channel_separable on|off;` (off: a child scheme can undo its parent's). */
    if (st->n_args == 1 && (k = choice_arg(S, st, arg(st, 0), "on|off")) < 0) return;
    sema_put_tensor(S, c, T_CS, k == 0, st->loc);
}

static void h_group(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    const ast_arg *a = arg(st, 0);
    char b[64];
    (void)d;
    if (a->kind == AST_IDENT && !strcmp(a->text, "all")) {
        sema_put_tensor(S, c, T_GROUP, KVQ_GROUP_ALL, st->loc);
    } else if (a->kind == AST_IDENT && !strcmp(a->text, "hidden")) {
        sema_put_tensor(S, c, T_GROUP, KVQ_GROUP_HIDDEN, st->loc);
    } else if (a->kind == AST_INT && a->num >= 1) {
        int v;
        if (int_arg(S, st, a, 1, SEMA_GROUP_MAX, &v)) sema_put_tensor(S, c, T_GROUP, v, st->loc);
    } else {
        ERR(a->loc, "group must be a positive number, 'all' or 'hidden', not '%s'", sema_q(b, sizeof b, a->text));
    }
}

static void h_dtype(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = choice_arg(S, st, arg(st, 0), "fp16|fp32");
    (void)d;
    if (k >= 0) sema_put_tensor(S, c, st->name[0] == 's' ? T_SCALE : T_ZERO, k, st->loc);
}

/* `rotate none|hadamard|random [seed S]` (docs/language.md, "Rotations"): hadamard without a seed has no random
 * signs; random needs its seed, so the matrix is named in the spec and every machine builds the same one. */
static void h_rotate(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = choice_arg(S, st, arg(st, 0), "none|hadamard|random"), seed = -1;
    (void)d;
    if (k < 0) return;
    if (st->n_args == 2) {
        ERR(st->loc, "usage: %s", d->usage);
        return;
    }
    if (st->n_args == 3) {
        if (k == KVQ_ROT_NONE) {
            ERR(arg(st, 1)->loc, "'rotate none' takes no seed");
            return;
        }
        if (choice_arg(S, st, arg(st, 1), "seed") < 0) return;
        if (arg(st, 2)->kind == AST_INT && arg(st, 2)->num < 0) {
            char q[64];
            ERR(arg(st, 2)->loc, "seed must not be negative, not '%s'", sema_q(q, sizeof q, arg(st, 2)->text));
            return;
        }
        if (!int_arg(S, st, arg(st, 2), 0, 2147483647, &seed)) return;
    } else if (k == KVQ_ROT_RANDOM) {
        ERR(st->loc, "rotate random needs a seed (rotate random seed S): the seed names the matrix, so every "
                     "backend and machine builds the same one");
        return;
    }
    sema_put_tensor(S, c, T_ROT, k, st->loc);
    sema_put_tensor(S, c, T_ROT_SEED, seed, st->loc);
}

/* `turboquant mse|prod seed S` (docs/language.md, "TurboQuant"): TurboQuant's quantizer of whole head vectors,
 * so it also sets per token, group all and `rotate random seed S` (Pi of the paper; S seeds the QJL matrix too).
 * `turboquant none` turns the quantizer off and leaves the rest. */
static void h_turboquant(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = choice_arg(S, st, arg(st, 0), "none|mse|prod"), seed = -1;
    if (k < 0) return;
    if (k == KVQ_TQ_NONE) {
        if (st->n_args > 1)
            ERR(arg(st, 1)->loc, "'turboquant none' takes no seed");
        else
            sema_put_tensor(S, c, T_TQ, KVQ_TQ_NONE, st->loc);
        return;
    }
    if (st->n_args != 3) {
        ERR(st->loc, "turboquant %s needs a seed (usage: %s): the seed names its random rotation and QJL matrix",
            k == KVQ_TQ_MSE ? "mse" : "prod", d->usage);
        return;
    }
    if (choice_arg(S, st, arg(st, 1), "seed") < 0) return;
    if (arg(st, 2)->kind == AST_INT && arg(st, 2)->num < 0) {
        char q[64];
        ERR(arg(st, 2)->loc, "seed must not be negative, not '%s'", sema_q(q, sizeof q, arg(st, 2)->text));
        return;
    }
    if (!int_arg(S, st, arg(st, 2), 0, 2147483647, &seed)) return;
    sema_put_tensor(S, c, T_TQ, k, st->loc);
    sema_put_tensor(S, c, T_GRAN, KVQ_GRAN_TOKEN, st->loc);
    sema_put_tensor(S, c, T_GROUP, KVQ_GROUP_ALL, st->loc);
    sema_put_tensor(S, c, T_ROT, KVQ_ROT_RANDOM, st->loc);
    sema_put_tensor(S, c, T_ROT_SEED, seed, st->loc);
}

/* `outlier_channels N bits B` (docs/language.md, "TurboQuant's channel split"): the paper's non-integer bits
 * (arXiv 2504.19874 Sec. 4.3): N outlier channels form a second, independent TurboQuant instance at B bits, the
 * other head_dim - N channels one at `bits`. Each instance packs its codes in 32-channel words, so N is a multiple
 * of 32. `outlier_channels 0` (or `none`) turns the split off. */
static void h_outlier_channels(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    const ast_arg *a = arg(st, 0);
    char q[64];
    int n = 0, bits = 0;
    if (a->kind == AST_IDENT && !strcmp(a->text, "none")) {
        if (st->n_args > 1) {
            ERR(arg(st, 1)->loc, "'outlier_channels none' takes no bits");
            return;
        }
    } else {
        if (!int_arg(S, st, a, 0, 224, &n)) return;
        if (n % 32) {
            ERR(a->loc, "outlier_channels must be a multiple of 32 (each TurboQuant instance packs its codes 32 "
                        "channels to a word), not '%s'", sema_q(q, sizeof q, a->text));
            return;
        }
        if (n == 0 && st->n_args > 1) {
            ERR(arg(st, 1)->loc, "'outlier_channels 0' takes no bits");
            return;
        }
        if (n > 0 && st->n_args != 3) {
            ERR(st->loc, "outlier_channels %d needs the outliers' bits (usage: %s)", n, d->usage);
            return;
        }
        if (n > 0) {
            if (choice_arg(S, st, arg(st, 1), "bits") < 0) return;
            const ast_arg *b = arg(st, 2);
            if (b->kind == AST_INT && (b->num < 1 || b->num > 4)) {
                ERR(b->loc, "outlier_channels bits must be 1 to 4 (TurboQuant's Lloyd-Max codebooks), not '%s'",
                    sema_q(q, sizeof q, b->text));
                return;
            }
            if (!int_arg(S, st, b, 1, 4, &bits)) return;
        }
    }
    sema_put_tensor(S, c, T_TQ_OUT, n, st->loc);
    sema_put_tensor(S, c, T_TQ_OUT_BITS, bits, st->loc);
}

static void h_tensor_block(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_ctx in = *c;
    in.kind = st->name[0] == 'k' ? B_KEY : B_VALUE;
    (void)d;
    sema_walk(S, st->block, &in);
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Statements: windows, flush, outliers, saliency */

static void h_count(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int v, f;
    (void)d;
    if (!strcmp(st->name, "sinks"))
        f = c->kind == B_WHEN_S ? F_SP_SINKS : F_SINKS;
    else if (!strcmp(st->name, "residual"))
        f = F_RESIDUAL;
    else if (!strcmp(st->name, "recent"))
        f = F_SP_RECENT;
    else if (!strcmp(st->name, "keep"))
        f = F_OUT_KEEP;
    else
        f = F_OUT_SPILL;
    if (int_arg(S, st, arg(st, 0), 0, f == F_OUT_KEEP ? SEMA_KEEP_MAX : SEMA_TOKENS_MAX, &v))
        sema_put(S, c, f, v, st->loc);
}

static void h_flush(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = choice_arg(S, st, arg(st, 0), "kivi|group");
    (void)d;
    if (k >= 0) sema_put(S, c, F_FLUSH, k, st->loc);
}

static void h_outliers(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_scheme *s = &S->all[S->cur];
    unsigned before = S->seq;
    sema_ctx in = *c;
    in.kind = B_OUTLIERS;
    (void)d;
    if (st->n_args == 1) {
        if (choice_arg(S, st, arg(st, 0), "none") < 0) return;
        if (st->block) {
            ERR(st->block->open, "'outliers none' takes no block");
            return;
        }
        sema_put(S, c, F_OUT_KEEP, 0, st->loc);
        sema_put(S, c, F_OUT_SPILL, 0, st->loc);
        return;
    }
    if (!st->block) {
        ERR(st->loc, "outliers needs a block: outliers { keep N; by key_l1 smallest|largest; spill N; }");
        return;
    }
    sema_walk(S, st->block, &in);
    /* A spill pool set in this block without any pool to spill from is a mistake (OTT Sec. 3.2: the spill
     * pool takes the tokens pushed out of the outlier pool). */
    if (c->range == RANGE_NONE) return;
    for (int i = -1; i < s->n_ranges; i++) {
        const sema_lcfg *t = i < 0 ? &s->base : &s->ranges[i].cfg;
        if (c->range >= 0 && (i < c->range || i >= c->range + c->n_range)) continue;
        if (t->c.quant.outliers.spill > 0 && t->c.quant.outliers.keep == 0 && t->p[F_OUT_SPILL].seq > before) {
            ERR(sema_prov_loc(&t->p[F_OUT_SPILL]),
                "spill %d without keep: the spill pool holds tokens pushed out of the outlier pool, so it needs "
                "keep N with N > 0",
                t->c.quant.outliers.spill);
            break;
        }
    }
}

static void h_by(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k;
    (void)d;
    if (choice_arg(S, st, arg(st, 0), "key_l1") < 0) return;
    if (st->n_args < 2) {
        ERR(st->loc, "by needs an order: by key_l1 smallest|largest");
        return;
    }
    k = choice_arg(S, st, arg(st, 1), "smallest|largest");
    if (k >= 0) sema_put(S, c, F_OUT_METRIC, k, st->loc);
}

static void h_saliency(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_ctx in = *c;
    in.kind = B_SALIENCY;
    int k = choice_arg(S, st, arg(st, 0), "normalized|accumulated|none");
    (void)d;
    if (k < 0) return;
    if (k == 2) {
        if (st->block) ERR(st->block->open, "'saliency none' takes no block");
        sema_put(S, c, F_SAL_METRIC, KVQ_SAL_NONE, st->loc);
        return;
    }
    sema_put(S, c, F_SAL_METRIC, k == 0 ? KVQ_SAL_NORMALIZED : KVQ_SAL_ACCUMULATED, st->loc);
    if (st->block) sema_walk(S, st->block, &in);
}

static void h_probes(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int seen[2] = {0, 0};
    char b[64];
    (void)d;
    if (st->n_args % 2) {
        ERR(st->loc, "probes takes pairs: probes recent P%% random P%%");
        return;
    }
    for (int i = 0; i < st->n_args; i += 2) {
        const ast_arg *a = arg(st, i);
        double v;
        int k = choice_arg(S, st, a, "recent|random");
        if (k < 0) return;
        if (seen[k]++) {
            ERR(a->loc, "'%s' given twice in probes", sema_q(b, sizeof b, a->text));
            return;
        }
        if (!pct_arg(S, k ? "random probes" : "recent probes", arg(st, i + 1), &v)) return;
        sema_put(S, c, k ? F_SAL_RANDOM : F_SAL_RECENT, v, a->loc);
    }
}

static void h_salient(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    double v;
    int bits;
    (void)d;
    if (st->n_args != 1 && st->n_args != 3) {
        ERR(st->loc, "usage: salient P%% [bits N]");
        return;
    }
    if (!pct_arg(S, "salient", arg(st, 0), &v)) return;
    if (st->n_args == 3) {
        if (choice_arg(S, st, arg(st, 1), "bits") < 0) return;
        if (!int_arg(S, st, arg(st, 2), 1, 16, &bits)) return;
        if (bits != 1 && bits != 2 && bits != 3 && bits != 4 && bits != 8 && bits != 16) {
            char b[64];
            ERR(arg(st, 2)->loc, "bits must be 1, 2, 3, 4, 8 or 16, not '%s'", sema_q(b, sizeof b, arg(st, 2)->text));
            return;
        }
        sema_put(S, c, F_SAL_HIGH, bits, arg(st, 1)->loc);
    }
    sema_put(S, c, F_SAL_SALIENT, v, st->loc);
}

static void h_rest(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int bits;
    char b[64];
    (void)d;
    if (choice_arg(S, st, arg(st, 0), "bits") < 0) return;
    if (st->n_args < 2) {
        ERR(st->loc, "usage: rest bits N");
        return;
    }
    if (!int_arg(S, st, arg(st, 1), 1, 16, &bits)) return;
    if (bits != 1 && bits != 2 && bits != 3 && bits != 4 && bits != 8 && bits != 16) {
        ERR(arg(st, 1)->loc, "bits must be 1, 2, 3, 4, 8 or 16, not '%s'", sema_q(b, sizeof b, arg(st, 1)->text));
        return;
    }
    sema_put(S, c, F_SAL_LOW, bits, st->loc);
}

static void h_every(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int v;
    (void)d;
    if (int_arg(S, st, arg(st, 0), 1, SEMA_TOKENS_MAX, &v)) sema_put(S, c, F_SAL_EVERY, v, st->loc);
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Statements: sparse layers (TailorKV) */

static void h_offload(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = 0;
    (void)d;
    if (st->n_args == 1 && (k = choice_arg(S, st, arg(st, 0), "on|off")) < 0) return;
    sema_put(S, c, F_SP_OFFLOAD, k == 0, st->loc);
}

static void h_topk(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int v;
    (void)d;
    if (int_arg(S, st, arg(st, 0), 1, SEMA_TOKENS_MAX, &v)) sema_put(S, c, F_SP_TOPK, v, st->loc);
}

static void h_critical(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int v;
    (void)d;
    if (int_arg(S, st, arg(st, 0), 1, 256, &v)) sema_put(S, c, F_SP_CRIT, v, st->loc);
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Statements: scheme level */

static void h_model(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_ctx in = *c;
    in.kind = B_MODEL;
    (void)d;
    sema_walk(S, st->block, &in);
}

static void h_model_dim(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    const ast_arg *a = arg(st, 0);
    int v, g;
    char b[64];
    (void)c;
    (void)d;
    g = !strcmp(st->name, "layers")     ? G_LAYERS
        : !strcmp(st->name, "heads")    ? G_HEADS
        : !strcmp(st->name, "kv_heads") ? G_KV_HEADS
                                        : G_HEAD_DIM;
    if (g == G_HEAD_DIM) {
        if (a->kind == AST_INT && (a->num == 64 || a->num == 96 || a->num == 128 || a->num == 256)) {
            sema_gput(S, g, a->num, st->loc);
            return;
        }
        ERR(a->loc, "head_dim must be 64, 96, 128 or 256 (the head sizes kvq supports), not '%s'",
            sema_q(b, sizeof b, a->text));
        return;
    }
    if (int_arg(S, st, a, 1, SEMA_LAYERS_MAX, &v)) sema_gput(S, g, v, st->loc);
}

static void h_classify(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_ctx in = *c;
    in.kind = B_CLASSIFY;
    (void)d;
    if (choice_arg(S, st, arg(st, 0), "dense_preference") < 0) return;
    sema_gput(S, G_CLASSIFY, 1, st->loc);
    /* Calibration decides every layer's mode unless a later statement says otherwise. */
    sema_put(S, c, F_MODE, KVQ_MODE_AUTO, st->loc);
    if (st->block) sema_walk(S, st->block, &in);
}

static void h_queries(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int v;
    (void)c;
    (void)d;
    if (int_arg(S, st, arg(st, 0), 1, SEMA_TOKENS_MAX, &v)) sema_gput(S, G_QUERIES, v, st->loc);
}

static void h_top(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    double v;
    char b[64];
    (void)c;
    (void)d;
    if (!pct_arg(S, "top", arg(st, 0), &v)) return;
    if (v <= 0) {
        ERR(arg(st, 0)->loc, "top must be more than 0%%, not '%s'", sema_q(b, sizeof b, arg(st, 0)->text));
        return;
    }
    sema_gput(S, G_TOP, v, st->loc);
}

static void h_tau(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    const ast_arg *a = arg(st, 0);
    char b[64];
    (void)c;
    (void)d;
    if (a->kind != AST_INT && a->kind != AST_REAL) {
        ERR(a->loc, "expected a number after 'tau', found '%s'", sema_q(b, sizeof b, a->text));
        return;
    }
    if (a->num < 0) {
        ERR(a->loc, "tau must not be negative, not '%s'", sema_q(b, sizeof b, a->text));
        return;
    }
    sema_gput(S, G_TAU, a->num, st->loc);
}

static void h_when(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_scheme *s = &S->all[S->cur];
    int k = choice_arg(S, st, arg(st, 0), "quantize|sparse");
    sema_ctx in = *c;
    (void)d;
    if (k < 0) return;
    if (!s->when_at.line) s->when_at = sema_here(S, st->loc);
    in.kind = k ? B_WHEN_S : B_WHEN_Q;
    sema_walk(S, st->block, &in);
}

static void h_mode(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    int k = choice_arg(S, st, arg(st, 0), "quantize|sparse|auto");
    (void)d;
    if (k >= 0) sema_put(S, c, F_MODE, k, st->loc);
}

/* The configuration layer l has now: the last range covering it, else the base. */
static int source_of(const sema_scheme *s, int l)
{
    for (int i = s->n_ranges - 1; i >= 0; i--)
        if (l >= s->ranges[i].lo && l <= s->ranges[i].hi) return i;
    return -1;
}

/* A `layers lo..hi` block overrides only what it sets: it becomes one new range per run of layers that share
 * their current configuration (an earlier range's, or the base), each starting as a copy of that. Ranges are
 * complete configurations and the last covering range wins, so this keeps the earlier ranges' settings. */
static int new_pieces(sema_state *S, sema_scheme *s, int lo, int hi, ast_loc at, ast_loc stmt, sema_ctx *in)
{
    int first = s->n_ranges, l = lo;
    while (l <= hi) {
        int src = source_of(s, l), end = l;
        sema_range *r;
        while (end < hi && source_of(s, end + 1) == src) end++;
        if (s->n_ranges >= KVQ_MAX_LAYER_RANGES) {
            if (!s->ranges_full++)
                ERR(stmt,
                    "too many layer ranges in scheme '%s' (at most %d, counting the pieces a range is split "
                    "into where it overlaps earlier ones)",
                    s->item->name, KVQ_MAX_LAYER_RANGES);
            s->n_ranges = first; /* drop the pieces made so far */
            return 0;
        }
        if (!sema_reserve_ranges(S, s, s->n_ranges + 1)) return 0;
        r = &s->ranges[s->n_ranges];
        r->cfg = src < 0 ? s->base : s->ranges[src].cfg;
        r->lo = l;
        r->hi = end;
        r->stmt_lo = lo;
        r->stmt_hi = hi;
        r->at = sema_here(S, at);
        s->n_ranges++;
        l = end + 1;
    }
    in->range = first;
    in->n_range = s->n_ranges - first;
    return 1;
}

static void h_layers(sema_state *S, const ast_stmt *st, const sema_ctx *c, const stmt_def *d)
{
    sema_scheme *s = &S->all[S->cur];
    const ast_arg *a = arg(st, 0);
    sema_ctx in = {B_LAYERS, RANGE_NONE, 0};
    int lo = 0, hi = 0, ok = 1;
    char b[64];
    (void)c;
    (void)d;
    if (a->kind == AST_INT) {
        ok = int_arg(S, st, a, 0, SEMA_LAYERS_MAX - 1, &lo);
        hi = lo;
    } else if (a->kind == AST_RANGE && a->num == 0) {
        lo = a->lo;
        hi = a->hi;
        if (lo < 0 || hi < 0) {
            ERR(a->loc, "layer numbers must not be negative, not '%s'", sema_q(b, sizeof b, a->text));
            ok = 0;
        } else if (lo > hi) {
            ERR(a->loc, "layer range '%s' is reversed (write %d..%d)", sema_q(b, sizeof b, a->text), hi, lo);
            ok = 0;
        } else if (hi >= SEMA_LAYERS_MAX) {
            ERR(a->loc, "layer range '%s' is too large (layers go up to %d)", sema_q(b, sizeof b, a->text),
                SEMA_LAYERS_MAX - 1);
            ok = 0;
        }
    } else {
        ERR(a->loc, "layers needs a layer or a range like 0..3, not '%s'", sema_q(b, sizeof b, a->text));
        ok = 0;
    }
    if (ok) ok = new_pieces(S, s, lo, hi, a->loc, st->loc, &in);
    sema_walk(S, st->block, &in);
}

/* ---------------------------------------------------------------------------------------------------------- */
/* The statement table and the block walk */

static const stmt_def DEFS[] = {
    {"bits", M_TENSOR, h_bits, NO_BLOCK, 1, 1, "bits 1|2|3|4|8|16", 0},
    {"per", M_TENSOR, h_per, NO_BLOCK, 1, 1, "per channel|token", 0},
    {"channel_separable", M_TENSOR, h_cs, NO_BLOCK, 0, 1, "channel_separable [on|off]", 0},
    {"group", M_TENSOR, h_group, NO_BLOCK, 1, 1, "group N|all|hidden", 0},
    {"scale", M_TENSOR, h_dtype, NO_BLOCK, 1, 1, "scale fp16|fp32", 0},
    {"zero", M_TENSOR, h_dtype, NO_BLOCK, 1, 1, "zero fp16|fp32", 0},
    /* element formats: sema_format.c */
    {"format", M_TENSOR, sema_h_format, NO_BLOCK, 1, 1 + KVQ_CODEBOOK_MAX,
     "format int [symmetric] | q8_0 | q4_0 | q4_1 | q5_0 | q5_1 | e4m3 | e5m2 | nvfp4 | mxfp4 | codebook normal|L1 L2 ...", 0},
    {"tensor_scale", M_TENSOR, sema_h_tensor_scale, NO_BLOCK, 1, 3, "tensor_scale X | prompt [per head]", 0},
    {"rotate", M_TENSOR, h_rotate, NO_BLOCK, 1, 3, "rotate none|hadamard|random [seed S]", 0},
    {"turboquant", M_TENSOR, h_turboquant, NO_BLOCK, 1, 3, "turboquant none|mse|prod seed S", 0},
    {"outlier_channels", M_TENSOR, h_outlier_channels, NO_BLOCK, 1, 3, "outlier_channels N bits B | none", 0},
    {"key", M_QUANT, h_tensor_block, NEEDS_BLOCK, 0, 0, "key { ... }", 0},
    {"value", M_QUANT, h_tensor_block, NEEDS_BLOCK, 0, 0, "value { ... }", 0},
    {"sinks", M_QUANT | B_WHEN_S, h_count, NO_BLOCK, 1, 1, "sinks N", 0},
    {"residual", M_QUANT, h_count, NO_BLOCK, 1, 1, "residual N", 0},
    {"flush", M_QUANT, h_flush, NO_BLOCK, 1, 1, "flush kivi|group", 0},
    {"outliers", M_QUANT, h_outliers, MAY_BLOCK, 0, 1, "outliers { ... } or outliers none", 0},
    {"saliency", M_QUANT, h_saliency, MAY_BLOCK, 1, 1, "saliency normalized|accumulated|none [{ ... }]", 0},
    {"keep", B_OUTLIERS, h_count, NO_BLOCK, 1, 1, "keep N", 0},
    {"by", B_OUTLIERS, h_by, NO_BLOCK, 1, 2, "by key_l1 smallest|largest", 0},
    {"spill", B_OUTLIERS, h_count, NO_BLOCK, 1, 1, "spill N", 0},
    {"probes", B_SALIENCY, h_probes, NO_BLOCK, 2, 4, "probes recent P% random P%", 0},
    {"salient", B_SALIENCY, h_salient, NO_BLOCK, 1, 3, "salient P% [bits N]", 0},
    {"rest", B_SALIENCY, h_rest, NO_BLOCK, 1, 2, "rest bits N", 0},
    {"every", B_SALIENCY, h_every, NO_BLOCK, 1, 1, "every N", 0},
    {"host_offload", B_WHEN_S, h_offload, NO_BLOCK, 0, 1, "host_offload [on|off]", 0},
    {"recent", B_WHEN_S, h_count, NO_BLOCK, 1, 1, "recent N", 0},
    {"topk", B_WHEN_S, h_topk, NO_BLOCK, 1, 1, "topk N", 0},
    {"critical_channels", B_WHEN_S, h_critical, NO_BLOCK, 1, 1, "critical_channels N", 0},
    {"model", B_SCHEME, h_model, NEEDS_BLOCK, 0, 0, "model { layers N; heads N; kv_heads N; head_dim N; }", 0},
    {"layers", B_MODEL, h_model_dim, NO_BLOCK, 1, 1, "layers N", 0},
    {"heads", B_MODEL, h_model_dim, NO_BLOCK, 1, 1, "heads N", 0},
    {"kv_heads", B_MODEL, h_model_dim, NO_BLOCK, 1, 1, "kv_heads N", 0},
    {"head_dim", B_MODEL, h_model_dim, NO_BLOCK, 1, 1, "head_dim 64|96|128|256", 0},
    {"classify", B_SCHEME, h_classify, MAY_BLOCK, 1, 1, "classify dense_preference { ... }", 0},
    {"queries", B_CLASSIFY, h_queries, NO_BLOCK, 1, 1, "queries N", 0},
    {"top", B_CLASSIFY, h_top, NO_BLOCK, 1, 1, "top P%", 0},
    {"tau", B_CLASSIFY, h_tau, NO_BLOCK, 1, 1, "tau X", 0},
    {"when", B_SCHEME | B_LAYERS, h_when, NEEDS_BLOCK, 1, 1, "when quantize|sparse { ... }", 0},
    {"layers", B_SCHEME, h_layers, NEEDS_BLOCK, 1, 1, "layers A..B { ... }", 1},
    {"mode", B_SCHEME | B_LAYERS, h_mode, NO_BLOCK, 1, 1, "mode quantize|sparse|auto", 0},
};
#define N_DEFS ((int)(sizeof DEFS / sizeof DEFS[0]))

int sema_edit_distance(const char *a, const char *b)
{
    int la = (int)strlen(a), lb = (int)strlen(b), row[64];
    if (la > 63 || lb > 63 || la - lb > 2 || lb - la > 2) return 99;
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[lb];
}

static void unknown_stmt(sema_state *S, const ast_stmt *st, unsigned kind)
{
    const char *best = NULL;
    int best_d = 3, n = 0;
    char b[64], list[400];
    size_t len = 0;
    for (int i = 0; i < N_DEFS; i++) {
        int dist;
        if (!(DEFS[i].where & kind)) continue;
        n++;
        dist = sema_edit_distance(st->name, DEFS[i].name);
        if (dist < best_d) {
            best_d = dist;
            best = DEFS[i].name;
        }
    }
    if (best) {
        ERR(st->loc, "unknown keyword '%s' in %s; did you mean '%s'?", sema_q(b, sizeof b, st->name), block_name(kind),
            best);
        return;
    }
    list[0] = '\0';
    for (int i = 0, k = 0; i < N_DEFS; i++) {
        int w;
        if (!(DEFS[i].where & kind)) continue;
        w = snprintf(list + len, sizeof list - len, "%s%s", k == 0 ? "" : k == n - 1 ? " or " : ", ", DEFS[i].name);
        if (w > 0 && (size_t)w < sizeof list - len) len += (size_t)w;
        k++;
    }
    ERR(st->loc, "unknown keyword '%s' in %s; expected %s", sema_q(b, sizeof b, st->name), block_name(kind), list);
}

static const stmt_def *lookup(sema_state *S, const ast_stmt *st, unsigned kind)
{
    unsigned elsewhere = 0;
    char b[64];
    for (int i = 0; i < N_DEFS; i++) {
        if (strcmp(DEFS[i].name, st->name) != 0) continue;
        if (DEFS[i].where & kind) return &DEFS[i];
        elsewhere |= DEFS[i].where;
    }
    if (!elsewhere) {
        unknown_stmt(S, st, kind);
        return NULL;
    }
    /* Where it belongs, when that is one place. */
    if ((elsewhere & (elsewhere - 1)) == 0)
        ERR(st->loc, "'%s' is not allowed in %s; it belongs in %s", sema_q(b, sizeof b, st->name), block_name(kind),
            block_name(elsewhere));
    else
        ERR(st->loc, "'%s' is not allowed in %s", sema_q(b, sizeof b, st->name), block_name(kind));
    return NULL;
}

/* Checks the shape of a statement against its definition: argument count and block. */
static int shape_ok(sema_state *S, const ast_stmt *st, const stmt_def *d)
{
    char b[64];
    if (st->n_args < d->min_args) {
        ERR(st->loc, "'%s' needs a value (usage: %s)", sema_q(b, sizeof b, st->name), d->usage);
        return 0;
    }
    if (st->n_args > d->max_args) {
        const ast_arg *a = arg(st, d->max_args);
        ERR(a->loc, "unexpected '%s' (usage: %s)", sema_q(b, sizeof b, a->text), d->usage);
        return 0;
    }
    if (d->block == NEEDS_BLOCK && !st->block) {
        ERR(st->loc, "'%s' needs a block (usage: %s)", sema_q(b, sizeof b, st->name), d->usage);
        return 0;
    }
    if (d->block == NO_BLOCK && st->block) {
        ERR(st->block->open, "'%s' takes no block (usage: %s)", sema_q(b, sizeof b, st->name), d->usage);
        return 0;
    }
    return 1;
}

/* Two statements are duplicates when they have the same keyword (and, for `when`, the same mode). */
static int same_stmt(const ast_stmt *a, const ast_stmt *b)
{
    if (strcmp(a->name, b->name) != 0) return 0;
    if (!strcmp(a->name, "when")) return a->args && b->args && !strcmp(a->args->text, b->args->text);
    return 1;
}

enum { SEEN_MAX = 64 };

void sema_walk(sema_state *S, const ast_block *b, const sema_ctx *c)
{
    const ast_stmt *seen[SEEN_MAX];
    int n_seen = 0;
    char q1[64];
    if (!b) return;
    for (const ast_stmt *st = b->body; st; st = st->next) {
        const stmt_def *d;
        int dup = 0, bad = 0;
        if (S->dl->stopped || S->nomem) return;
        if (!(d = lookup(S, st, c->kind)) || !shape_ok(S, st, d)) continue;
        /* A value the lexer already rejected (too large, unterminated) would only repeat its message. */
        for (const ast_arg *a = st->args; a; a = a->next) bad |= a->bad;
        if (bad) continue;
        if (!d->repeatable) {
            for (int i = 0; i < n_seen && !dup; i++) {
                if (!same_stmt(seen[i], st)) continue;
                ERR(st->loc, "duplicate '%s' in this block (the first is at line %d)", sema_q(q1, sizeof q1, st->name),
                    seen[i]->loc.line);
                dup = 1;
            }
            if (dup) continue;
            if (n_seen < SEEN_MAX) seen[n_seen++] = st;
        }
        d->fn(S, st, c, d);
    }
}
