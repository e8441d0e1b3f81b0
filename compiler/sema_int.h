/* Internals of semantic analysis shared by sema.c (fields, resolution, checks) and sema_stmt.c (the statements
 * and the block walk). Not part of any public interface. */
#ifndef KVQ_SEMA_INT_H
#define KVQ_SEMA_INT_H

#include <stddef.h>

#include "sema.h"

/* ---------------------------------------------------------------------------------------------------------- */
/* Fields of a layer configuration, addressed by number so a statement can be applied to many layers at once
 * and every field can carry a provenance. */

enum {
    T_BITS,
    T_GRAN,
    T_CS,
    T_GROUP,
    T_SCALE,
    T_ZERO,
    /* element formats (sema_format.c) */
    T_FORMAT,
    T_TSCALE,
    T_ROT,      /* rotate: kvq_rotation (sema_stmt.c h_rotate sets both rotation fields) */
    T_ROT_SEED,
    T_TQ,       /* turboquant: kvq_turboquant (h_turboquant also sets per token, group all, rotate random) */
    T_TQ_OUT,   /* outlier_channels N bits B: TurboQuant's channel split (h_outlier_channels sets both) */
    T_TQ_OUT_BITS,
    T_COUNT
};
enum {
    F_MODE,
    F_KEY,
    F_VALUE = F_KEY + T_COUNT,
    F_SINKS = F_VALUE + T_COUNT,
    F_RESIDUAL,
    F_FLUSH,
    F_OUT_KEEP,
    F_OUT_METRIC,
    F_OUT_SPILL,
    F_SAL_METRIC,
    F_SAL_RECENT,
    F_SAL_RANDOM,
    F_SAL_SALIENT,
    F_SAL_HIGH,
    F_SAL_LOW,
    F_SAL_EVERY,
    F_SP_OFFLOAD,
    F_SP_SINKS,
    F_SP_RECENT,
    F_SP_TOPK,
    F_SP_CRIT,
    F_COUNT
};
/* Scheme-wide fields. */
enum { G_LAYERS, G_HEADS, G_KV_HEADS, G_HEAD_DIM, G_CLASSIFY, G_QUERIES, G_TOP, G_TAU, G_COUNT };

typedef struct {
    const diag_src *src; /* NULL: a default */
    int line, col;
    int owner;           /* index of the scheme whose statement set it; -1: default */
    unsigned seq;        /* order of setting, over the whole resolution */
} sema_prov;

typedef struct {
    kvq_layer_cfg c;
    sema_prov p[F_COUNT];
} sema_lcfg;

typedef struct {
    int lo, hi;
    int stmt_lo, stmt_hi; /* the range as written (a `layers` block may be split into several pieces) */
    sema_prov at;
    sema_lcfg cfg;
} sema_range;

typedef struct {
    const ast_item *item;
    const diag_src *src;
    int state;           /* 0: not yet, 1: being resolved (on the inheritance chain), 2: done */
    kvq_model_dims model;
    kvq_classify_cfg classify;
    sema_prov g[G_COUNT];
    sema_lcfg base;
    sema_range *ranges;
    int n_ranges, cap_ranges;
    sema_prov when_at;        /* first `when` of this scheme's own body (line 0: none) */
    int ranges_full;          /* "too many layer ranges" was reported */
} sema_scheme;

typedef struct {
    diag_list *dl;
    sema_scheme *all;
    int n;
    int cur;             /* the scheme being resolved */
    const diag_src *src; /* its file */
    unsigned seq;
    int nomem;
    int *table;          /* name hash table: index + 1, 0 empty */
    int table_size;
} sema_state;

/* ---------------------------------------------------------------------------------------------------------- */
/* Where statements may appear */

enum {
    B_SCHEME = 1 << 0,
    B_LAYERS = 1 << 1,
    B_WHEN_Q = 1 << 2,
    B_WHEN_S = 1 << 3,
    B_KEY = 1 << 4,
    B_VALUE = 1 << 5,
    B_OUTLIERS = 1 << 6,
    B_SALIENCY = 1 << 7,
    B_CLASSIFY = 1 << 8,
    B_MODEL = 1 << 9
};
#define M_QUANT (B_SCHEME | B_LAYERS | B_WHEN_Q)
#define M_TENSOR (M_QUANT | B_KEY | B_VALUE)

#define RANGE_ALL (-1)  /* scheme level: the base and every range */
#define RANGE_NONE (-2) /* an invalid layers block: check its body, apply nothing */

typedef struct {
    unsigned kind;
    int range;   /* RANGE_ALL, RANGE_NONE, or the first of n_range ranges (the pieces of one layers block) */
    int n_range;
} sema_ctx;

/* Diagnostics. */
void sema_error(sema_state *S, const diag_src *src, ast_loc at, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void sema_warn(sema_state *S, const diag_src *src, ast_loc at, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define ERR(loc, ...) sema_error(S, S->src, (loc), __VA_ARGS__)
static inline const char *sema_q(char *buf, size_t n, const char *s) { return ast_diag_quote(buf, n, s, 40); }
static inline ast_loc sema_prov_loc(const sema_prov *p)
{
    ast_loc l = {p->line, p->col, p->line, p->col};
    return l;
}

/* Applying values: to the targets of c (the base and every range, or one range), with provenance. */
sema_prov sema_here(sema_state *S, ast_loc at);
void sema_put(sema_state *S, const sema_ctx *c, int f, double v, ast_loc at);
void sema_put_tensor(sema_state *S, const sema_ctx *c, int t, double v, ast_loc at);
void sema_gput(sema_state *S, int g, double v, ast_loc at);
/* Sets the element format (kind and codebook; a target's tensor scale is kept) of the tensors of c. */
void sema_put_format(sema_state *S, const sema_ctx *c, const kvq_format_cfg *f, ast_loc at);

/* Makes room for `need` ranges in s (at most KVQ_MAX_LAYER_RANGES); 0 when out of memory. */
int sema_reserve_ranges(sema_state *S, sema_scheme *s, int need);

/* The statements of a block, applied in order (sema_stmt.c). */
void sema_walk(sema_state *S, const ast_block *b, const sema_ctx *c);

/* Element formats (sema_format.c): the `format` and `tensor_scale` statements, and the checks of a resolved
 * tensor's format (bits, granularity, group, scale and zero against what the format fixes). */
struct stmt_def;
void sema_h_format(sema_state *S, const ast_stmt *st, const sema_ctx *c, const struct stmt_def *d);
void sema_h_tensor_scale(sema_state *S, const ast_stmt *st, const sema_ctx *c, const struct stmt_def *d);
void sema_check_format(sema_state *S, const sema_scheme *s, const sema_lcfg *t, int key);
/* Fills a `codebook normal` tensor's levels for its bits (Lloyd-Max for N(0,1), base/lloyd_max.h). */
void sema_finish_format(sema_lcfg *t);

/* The statement to blame for a rule involving fields ps[0..n): the latest one this scheme set. NULL when all
 * of them come from the parent or the defaults (then the parent has reported it already). */
const sema_prov *sema_blame(const sema_state *S, const sema_prov *const *ps, int n);
#define BLAME(...)                                                                                                     \
    sema_blame(S, (const sema_prov *const[]){__VA_ARGS__},                                                             \
               (int)(sizeof((const sema_prov *const[]){__VA_ARGS__}) / sizeof(const sema_prov *)))
int sema_edit_distance(const char *a, const char *b);

#endif
