/* Semantic analysis of .kvq schemes: fields, resolution, inheritance and the checks on a resolved scheme.
 * The statements themselves are in sema_stmt.c.
 *
 * Model: every scheme starts from the defaults (or a copy of its parent's resolved state) and applies its
 * statements in source order. A statement at scheme level applies to every layer: the base configuration and
 * every layer range that exists at that point; a statement inside `layers A..B { }` applies to that range only.
 * A new range starts as a copy of the base. So "later wins", whichever way round scheme-level and per-layer
 * statements come.
 *
 * Each field remembers where it was last set (its provenance), so cross-field checks done after the whole
 * scheme is applied can point at the statement that broke the rule, and can stay quiet about a rule that a
 * parent already broke (the parent reported it).
 *
 * Recursion is bounded: block walking follows the source nesting, which the lexer caps at 64 levels, and
 * inheritance chains are resolved iteratively. */
#include "sema.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "sema_int.h"

static void tset(kvq_tensor_cfg *t, int k, double v)
{
    int i = (int)v;
    switch (k) {
    case T_BITS: t->bits = i; break;
    case T_GRAN: t->gran = i ? KVQ_GRAN_TOKEN : KVQ_GRAN_CHANNEL; break;
    case T_CS: t->channel_separable = i; break;
    case T_GROUP: t->group = i; break;
    case T_SCALE: t->scale_dtype = i ? KVQ_DT_FP32 : KVQ_DT_FP16; break;
    case T_ZERO: t->zero_dtype = i ? KVQ_DT_FP32 : KVQ_DT_FP16; break;
    case T_FORMAT: break; /* sema_put_format: a format is more than a number */
    case T_ROT: t->rotate = i == 1 ? KVQ_ROT_HADAMARD : i == 2 ? KVQ_ROT_RANDOM : KVQ_ROT_NONE; break;
    case T_ROT_SEED: t->rotate_seed = i; break;
    case T_TQ: t->turboquant = i == 1 ? KVQ_TQ_MSE : i == 2 ? KVQ_TQ_PROD : KVQ_TQ_NONE; break;
    case T_TQ_OUT: t->tq_outliers = i; break;
    case T_TQ_OUT_BITS: t->tq_outlier_bits = i; break;
    default: /* T_TSCALE */
        t->format.tensor_scale = v < 0 ? KVQ_TENSOR_SCALE_PROMPT : (float)v;
        t->format.tensor_scale_per_head = v < 0;
        break;
    }
}

static void cset(kvq_layer_cfg *c, int f, double v)
{
    kvq_quant_cfg *q = &c->quant;
    int i = (int)v;
    if (f >= F_KEY && f < F_KEY + T_COUNT) {
        tset(&q->key, f - F_KEY, v);
        return;
    }
    if (f >= F_VALUE && f < F_VALUE + T_COUNT) {
        tset(&q->value, f - F_VALUE, v);
        return;
    }
    switch (f) {
    case F_MODE: c->mode = i == 1 ? KVQ_MODE_SPARSE : i == 2 ? KVQ_MODE_AUTO : KVQ_MODE_QUANT; break;
    case F_SINKS: q->sinks = i; break;
    case F_RESIDUAL: q->residual = i; break;
    case F_FLUSH: q->flush = i ? KVQ_FLUSH_GROUP : KVQ_FLUSH_KIVI; break;
    case F_OUT_KEEP: q->outliers.keep = i; break;
    case F_OUT_METRIC: q->outliers.metric = i ? KVQ_OUTLIER_KEY_L1_LARGEST : KVQ_OUTLIER_KEY_L1_SMALLEST; break;
    case F_OUT_SPILL: q->outliers.spill = i; break;
    case F_SAL_METRIC:
        q->saliency.metric = i == 1 ? KVQ_SAL_NORMALIZED : i == 2 ? KVQ_SAL_ACCUMULATED : KVQ_SAL_NONE;
        break;
    case F_SAL_RECENT: q->saliency.probe_recent = v; break;
    case F_SAL_RANDOM: q->saliency.probe_random = v; break;
    case F_SAL_SALIENT: q->saliency.salient = v; break;
    case F_SAL_HIGH: q->saliency.high_bits = i; break;
    case F_SAL_LOW: q->saliency.low_bits = i; break;
    case F_SAL_EVERY: q->saliency.interval = i; break;
    case F_SP_OFFLOAD: c->sparse.host_offload = i; break;
    case F_SP_SINKS: c->sparse.sinks = i; break;
    case F_SP_RECENT: c->sparse.recent = i; break;
    case F_SP_TOPK: c->sparse.topk = i; break;
    default: c->sparse.critical_channels = i; break;
    }
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Defaults (docs/language.md, "Defaults": keep the two in step) */

void sema_default_layer(kvq_layer_cfg *c)
{
    memset(c, 0, sizeof *c);
    c->mode = KVQ_MODE_QUANT;
    /* Unquantized unless a scheme says `bits`; KIVI's granularity (keys per channel, values per token) and
     * group size 32. */
    c->quant.key = (kvq_tensor_cfg){.bits = 16, .gran = KVQ_GRAN_CHANNEL, .group = 32, .scale_dtype = KVQ_DT_FP16,
                                    .zero_dtype = KVQ_DT_FP16, .rotate = KVQ_ROT_NONE, .rotate_seed = -1};
    c->quant.value = (kvq_tensor_cfg){.bits = 16, .gran = KVQ_GRAN_TOKEN, .group = 32, .scale_dtype = KVQ_DT_FP16,
                                      .zero_dtype = KVQ_DT_FP16, .rotate = KVQ_ROT_NONE, .rotate_seed = -1};
    /* format int (asymmetric integers), tensor scale 'prompt' where a format has one: the zeros. */
    c->quant.sinks = 0;
    c->quant.residual = 0;
    c->quant.flush = KVQ_FLUSH_KIVI;
    c->quant.outliers = (kvq_outlier_cfg){0, KVQ_OUTLIER_KEY_L1_SMALLEST, 0};
    /* Off; when a scheme turns it on, ZipCache's settings (Sec. 4.3, 5.1). */
    c->quant.saliency = (kvq_saliency_cfg){KVQ_SAL_NONE, 0.05, 0.05, 0.6, 4, 2, 100};
    /* TailorKV's LongBench settings (Sec. 5.1): 64 local tokens (here 8 sinks + 56 recent), top-k 128,
     * 8 critical channels, K/V offloaded to the host. */
    c->sparse = (kvq_sparse_cfg){1, 8, 56, 128, 8};
}

void sema_default_classify(kvq_classify_cfg *c)
{
    /* TailorKV tau = 0.2 (Sec. 5.1); n_q and the top fraction are not given in the paper: 32 queries and the top
     * 5% (the fraction of its Figure 1). */
    *c = (kvq_classify_cfg){0, 32, 0.05, 0.2};
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Diagnostics */

static void report(sema_state *S, kvq_diag_severity sev, const diag_src *src, ast_loc at, const char *fmt, va_list ap)
{
    char msg[640];
    vsnprintf(msg, sizeof msg, fmt, ap);
    ast_diag_add(S->dl, sev, src, at.line, at.col, "%s", msg);
}

void sema_error(sema_state *S, const diag_src *src, ast_loc at, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(S, KVQ_DIAG_ERROR, src, at, fmt, ap);
    va_end(ap);
}

void sema_warn(sema_state *S, const diag_src *src, ast_loc at, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    report(S, KVQ_DIAG_WARNING, src, at, fmt, ap);
    va_end(ap);
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Applying values */

static void set_field(sema_lcfg *t, int f, double v, const sema_prov *p)
{
    cset(&t->c, f, v);
    t->p[f] = *p;
}

sema_prov sema_here(sema_state *S, ast_loc at)
{
    sema_prov p = {S->src, at.line, at.col, S->cur, ++S->seq};
    return p;
}

void sema_put(sema_state *S, const sema_ctx *c, int f, double v, ast_loc at)
{
    sema_scheme *s = &S->all[S->cur];
    sema_prov p = sema_here(S, at);
    if (c->range == RANGE_NONE) return;
    if (c->range >= 0) {
        for (int i = c->range; i < c->range + c->n_range; i++) set_field(&s->ranges[i].cfg, f, v, &p);
        return;
    }
    set_field(&s->base, f, v, &p);
    for (int i = 0; i < s->n_ranges; i++) set_field(&s->ranges[i].cfg, f, v, &p);
}

void sema_gput(sema_state *S, int g, double v, ast_loc at)
{
    sema_scheme *s = &S->all[S->cur];
    switch (g) {
    case G_LAYERS: s->model.layers = (int)v; break;
    case G_HEADS: s->model.heads = (int)v; break;
    case G_KV_HEADS: s->model.kv_heads = (int)v; break;
    case G_HEAD_DIM: s->model.head_dim = (int)v; break;
    case G_CLASSIFY: s->classify.enabled = (int)v; break;
    case G_QUERIES: s->classify.queries = (int)v; break;
    case G_TOP: s->classify.top = v; break;
    default: s->classify.tau = v; break;
    }
    s->g[g] = sema_here(S, at);
}

static void put_format_one(sema_lcfg *t, int key, const kvq_format_cfg *f, const sema_prov *p)
{
    kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
    float ts = x->format.tensor_scale;
    x->format = *f;
    x->format.tensor_scale = ts;
    t->p[(key ? F_KEY : F_VALUE) + T_FORMAT] = *p;
}

void sema_put_format(sema_state *S, const sema_ctx *c, const kvq_format_cfg *f, ast_loc at)
{
    sema_scheme *s = &S->all[S->cur];
    sema_prov p = sema_here(S, at);
    if (c->range == RANGE_NONE) return;
    for (int key = 1; key >= 0; key--) {
        if ((key && c->kind == B_VALUE) || (!key && c->kind == B_KEY)) continue;
        if (c->range >= 0) {
            for (int i = c->range; i < c->range + c->n_range; i++) put_format_one(&s->ranges[i].cfg, key, f, &p);
            continue;
        }
        put_format_one(&s->base, key, f, &p);
        for (int i = 0; i < s->n_ranges; i++) put_format_one(&s->ranges[i].cfg, key, f, &p);
    }
}

/* The tensors a tensor statement sets: one inside key { } / value { }, both elsewhere. */
void sema_put_tensor(sema_state *S, const sema_ctx *c, int t, double v, ast_loc at)
{
    if (c->kind != B_VALUE) sema_put(S, c, F_KEY + t, v, at);
    if (c->kind != B_KEY) sema_put(S, c, F_VALUE + t, v, at);
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Checks on the resolved scheme */

const sema_prov *sema_blame(const sema_state *S, const sema_prov *const *ps, int n)
{
    const sema_prov *best = NULL;
    for (int i = 0; i < n; i++)
        if (ps[i] && ps[i]->owner == S->cur && (!best || ps[i]->seq > best->seq)) best = ps[i];
    return best;
}

/* TurboQuant quantizes whole rotated head vectors with Lloyd-Max codes of 1-4 bits (the prod variant: b - 1 of
 * them plus its 1-bit QJL sketch). */
static void check_turboquant(sema_state *S, const sema_lcfg *t, int key)
{
    const kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
    const int F = key ? F_KEY : F_VALUE;
    const char *name = key ? "keys" : "values", *v = x->turboquant == KVQ_TQ_PROD ? "prod" : "mse";
    const sema_prov *b;
    int lo = x->turboquant == KVQ_TQ_PROD ? 2 : 1;
    if ((x->bits < lo || x->bits > 4) && (b = BLAME(&t->p[F + T_BITS], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b), "turboquant %s of the %s needs bits %d to 4, not %d%s", v, name, lo,
                   x->bits, lo == 2 ? " (b - 1 bits of codes plus the 1-bit QJL sketch)" : "");
    if ((x->gran != KVQ_GRAN_TOKEN || x->group != KVQ_GROUP_ALL || x->channel_separable) &&
        (b = BLAME(&t->p[F + T_GRAN], &t->p[F + T_GROUP], &t->p[F + T_CS], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "turboquant quantizes whole head vectors: the %s must stay per token, group all, without "
                   "channel_separable (turboquant sets the first two)",
                   name);
    if (x->rotate != KVQ_ROT_RANDOM && (b = BLAME(&t->p[F + T_ROT], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "turboquant needs rotate random (its codebook is the law of a randomly rotated unit vector's "
                   "coordinates); turboquant sets it, a later rotate changed it");
    if (x->format.kind != KVQ_FMT_INT && (b = BLAME(&t->p[F + T_FORMAT], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "turboquant stores its own codes (Lloyd-Max levels of a rotated unit vector); the %s cannot also "
                   "have format %s", name, kvq_format_name(x->format.kind));
    if (t->c.quant.saliency.metric != KVQ_SAL_NONE && (b = BLAME(&t->p[F_SAL_METRIC], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b), "turboquant and saliency cannot be combined (saliency needs two "
                                                "precision classes of the kvq quantizer)");
    /* The outlier instance is a TurboQuant instance of its own: the variant's bit range holds for it too */
    if (x->tq_outliers > 0 && x->turboquant == KVQ_TQ_PROD && x->tq_outlier_bits < 2 &&
        (b = BLAME(&t->p[F + T_TQ_OUT], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "turboquant prod of the %s needs outlier_channels bits 2 to 4, not %d (b - 1 bits of codes plus "
                   "the 1-bit QJL sketch)", name, x->tq_outlier_bits);
}

/* outlier_channels splits TurboQuant's head vector in two instances: without TurboQuant it means nothing, and it
 * must leave regular channels (head_dim known here; else kvq_scheme_check_dims at the model's dims). */
static void check_tq_split(sema_state *S, const sema_scheme *s, const sema_lcfg *t, int key)
{
    const kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
    const int F = key ? F_KEY : F_VALUE;
    const char *name = key ? "keys" : "values";
    const sema_prov *b;
    int hd = s->model.head_dim;
    if (x->tq_outliers <= 0) return;
    if (x->turboquant == KVQ_TQ_NONE && (b = BLAME(&t->p[F + T_TQ_OUT], &t->p[F + T_TQ])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "outlier_channels splits TurboQuant's head vectors into two instances; the %s need turboquant "
                   "mse|prod seed S",
                   name);
    else if (hd > 0 && x->tq_outliers >= hd && (b = BLAME(&t->p[F + T_TQ_OUT], &s->g[G_HEAD_DIM])))
        sema_error(S, b->src, sema_prov_loc(b), "%s outlier_channels %d leaves no regular channels at head_dim %d",
                   name, x->tq_outliers, hd);
}

static void check_tensor(sema_state *S, const sema_scheme *s, const sema_lcfg *t, int key)
{
    const kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
    const int F = key ? F_KEY : F_VALUE;
    const char *name = key ? "keys" : "values";
    const sema_prov *b;
    int hd = s->model.head_dim;

    if (kvq_bits_is_fp16(x->bits)) return;
    sema_check_format(S, s, t, key);
    if (x->turboquant != KVQ_TQ_NONE) check_turboquant(S, t, key);
    check_tq_split(S, s, t, key);
    if (x->channel_separable && x->gran == KVQ_GRAN_CHANNEL && (b = BLAME(&t->p[F + T_CS], &t->p[F + T_GRAN])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "channel_separable needs per token quantization, but the %s are per channel", name);
    if (x->group == KVQ_GROUP_HIDDEN && x->gran == KVQ_GRAN_CHANNEL &&
        (b = BLAME(&t->p[F + T_GROUP], &t->p[F + T_GRAN])))
        sema_error(S, b->src, sema_prov_loc(b), "group hidden needs per token quantization, but the %s are per channel",
                   name);
    if (x->gran == KVQ_GRAN_TOKEN && x->group > 0) {
        if (hd > 0 && hd % x->group != 0 && (b = BLAME(&t->p[F + T_GROUP], &t->p[F + T_GRAN], &s->g[G_HEAD_DIM])))
            sema_error(S, b->src, sema_prov_loc(b), "%s group %d does not divide head_dim %d", name, x->group, hd);
        if (hd == 0 && 64 % x->group && 96 % x->group && 128 % x->group && 256 % x->group &&
            (b = BLAME(&t->p[F + T_GROUP], &t->p[F + T_GRAN])))
            sema_error(S, b->src, sema_prov_loc(b),
                       "%s group %d divides none of the head sizes kvq supports (64, 96, 128, 256)", name, x->group);
    }
}

static void check_layer(sema_state *S, const sema_scheme *s, const sema_lcfg *t)
{
    const kvq_quant_cfg *qc = &t->c.quant;
    const kvq_tensor_cfg *k = &qc->key;
    const sema_prov *b;

    if (t->c.mode != KVQ_MODE_QUANT && !s->classify.enabled && (b = BLAME(&t->p[F_MODE])))
        sema_error(S, b->src, sema_prov_loc(b), "mode %s needs a classify block in the scheme",
                   t->c.mode == KVQ_MODE_SPARSE ? "sparse" : "auto");

    if (t->c.mode != KVQ_MODE_SPARSE) {
        check_tensor(S, s, t, 1);
        check_tensor(S, s, t, 0);
        /* KIVI Alg. 1 quantizes the keys R at a time, in per-channel groups of G tokens: R must split into
         * whole groups. */
        if (!kvq_bits_is_fp16(k->bits) && k->gran == KVQ_GRAN_CHANNEL && k->group > 0 && qc->flush == KVQ_FLUSH_KIVI &&
            qc->saliency.metric == KVQ_SAL_NONE && qc->residual % k->group != 0 &&
            (b = BLAME(&t->p[F_RESIDUAL], &t->p[F_KEY + T_GROUP], &t->p[F_KEY + T_GRAN], &t->p[F_FLUSH])))
            sema_error(S, b->src, sema_prov_loc(b),
                       "residual %d is not a multiple of the key group %d (flush kivi quantizes keys per channel, "
                       "residual tokens at a time)",
                       qc->residual, k->group);
        /* OTT quantizes every G steps, G being the key group. */
        if (!kvq_bits_is_fp16(k->bits) && qc->flush == KVQ_FLUSH_GROUP &&
            (k->gran != KVQ_GRAN_CHANNEL || k->group <= 0) &&
            (b = BLAME(&t->p[F_FLUSH], &t->p[F_KEY + T_GROUP], &t->p[F_KEY + T_GRAN])))
            sema_error(S, b->src, sema_prov_loc(b),
                       "flush group quantizes every G tokens, G being the key group: it needs keys per channel with a "
                       "numeric group");
        /* OTT replaces a pooled token's K and V slots in the same quantization step and masks them: keys and
         * values must be quantized together (flush group), and both must be quantized at all. */
        if (qc->outliers.keep > 0 && qc->saliency.metric == KVQ_SAL_NONE && qc->flush != KVQ_FLUSH_GROUP &&
            (b = BLAME(&t->p[F_OUT_KEEP], &t->p[F_FLUSH])))
            sema_error(S, b->src, sema_prov_loc(b),
                       "outliers need 'flush group' (OTT quantizes keys and values together every G tokens; flush "
                       "kivi quantizes values one at a time)");
        else if (qc->outliers.keep > 0 && (kvq_bits_is_fp16(k->bits) || kvq_bits_is_fp16(qc->value.bits)) &&
                 (b = BLAME(&t->p[F_OUT_KEEP], &t->p[F_KEY + T_BITS], &t->p[F_VALUE + T_BITS])))
            sema_error(S, b->src, sema_prov_loc(b),
                       "outliers need quantized keys and values (bits 16 keeps every token fp16 already)");
        if (qc->saliency.metric != KVQ_SAL_NONE) {
            const kvq_saliency_cfg *z = &qc->saliency;
            if (z->high_bits < z->low_bits && (b = BLAME(&t->p[F_SAL_HIGH], &t->p[F_SAL_LOW], &t->p[F_SAL_METRIC])))
                sema_error(S, b->src, sema_prov_loc(b),
                           "saliency gives salient tokens fewer bits (%d) than the rest (%d)", z->high_bits,
                           z->low_bits);
            if (z->probe_recent + z->probe_random > 1.0 + 1e-9 && (b = BLAME(&t->p[F_SAL_RECENT], &t->p[F_SAL_RANDOM])))
                sema_error(S, b->src, sema_prov_loc(b), "probes add up to more than 100%% of the tokens (%g%% + %g%%)",
                           z->probe_recent * 100, z->probe_random * 100);
            if (qc->outliers.keep > 0 && (b = BLAME(&t->p[F_OUT_KEEP], &t->p[F_SAL_METRIC])))
                sema_error(S, b->src, sema_prov_loc(b),
                           "outliers and saliency cannot be combined in one layer (both choose which tokens the "
                           "quantized body holds)");
        }
    }
    if (t->c.mode != KVQ_MODE_QUANT) {
        int hd = s->model.head_dim;
        if (hd > 0 && t->c.sparse.critical_channels > hd && (b = BLAME(&t->p[F_SP_CRIT], &s->g[G_HEAD_DIM])))
            sema_error(S, b->src, sema_prov_loc(b), "critical_channels %d is more than head_dim %d",
                       t->c.sparse.critical_channels, hd);
    }
}

/* Saliency sets the bits of the quantized body: the tensors' bits are the salient class's (ZipCache Sec. 4.2),
 * so code that reads only `bits` sees the high class. */
static void sync_saliency_bits(sema_state *S, sema_lcfg *t)
{
    kvq_saliency_cfg *z = &t->c.quant.saliency;
    if (z->metric == KVQ_SAL_NONE) return;
    for (int key = 1; key >= 0; key--) {
        int F = key ? F_KEY : F_VALUE;
        kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
        sema_prov *p = &t->p[F + T_BITS];
        if (p->owner == S->cur && x->bits != z->high_bits)
            sema_warn(S, p->src, sema_prov_loc(p),
                      "'bits %d' has no effect: saliency sets the bits (salient %d, rest %d)", x->bits, z->high_bits,
                      z->low_bits);
        x->bits = z->high_bits;
        *p = t->p[F_SAL_HIGH].owner >= 0 ? t->p[F_SAL_HIGH] : t->p[F_SAL_METRIC];
    }
}

static void finish(sema_state *S, sema_scheme *s)
{
    const sema_prov *b;
    if (s->model.heads > 0 && s->model.kv_heads > s->model.heads && (b = BLAME(&s->g[G_HEADS], &s->g[G_KV_HEADS])))
        sema_error(S, b->src, sema_prov_loc(b), "kv_heads %d is more than heads %d", s->model.kv_heads, s->model.heads);
    else if (s->model.heads > 0 && s->model.kv_heads > 0 && s->model.heads % s->model.kv_heads != 0 &&
             (b = BLAME(&s->g[G_HEADS], &s->g[G_KV_HEADS])))
        sema_error(S, b->src, sema_prov_loc(b), "heads %d is not a multiple of kv_heads %d", s->model.heads,
                   s->model.kv_heads);
    if (s->when_at.line && !s->classify.enabled)
        sema_error(S, s->when_at.src, sema_prov_loc(&s->when_at),
                   "'when' needs a classify block in the scheme (classify decides which layers quantize and which "
                   "go sparse)");

    sync_saliency_bits(S, &s->base);
    for (int i = 0; i < s->n_ranges; i++) sync_saliency_bits(S, &s->ranges[i].cfg);
    sema_finish_format(&s->base);
    for (int i = 0; i < s->n_ranges; i++) sema_finish_format(&s->ranges[i].cfg);

    check_layer(S, s, &s->base);
    for (int i = 0; i < s->n_ranges; i++) {
        sema_range *r = &s->ranges[i];
        check_layer(S, s, &r->cfg);
        if (s->model.layers > 0 && r->hi >= s->model.layers && (b = BLAME(&r->at, &s->g[G_LAYERS]))) {
            char text[32];
            if (r->stmt_lo == r->stmt_hi)
                snprintf(text, sizeof text, "%d", r->stmt_lo);
            else
                snprintf(text, sizeof text, "%d..%d", r->stmt_lo, r->stmt_hi);
            sema_error(S, b->src, sema_prov_loc(b), "layer range %s is beyond the model's %d layers (0..%d)", text,
                       s->model.layers, s->model.layers - 1);
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Inheritance */

static unsigned hash_name(const char *s)
{
    unsigned h = 2166136261u;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

static int find_scheme(const sema_state *S, const char *name)
{
    unsigned h = hash_name(name);
    for (int i = 0; i < S->table_size; i++) {
        int slot = S->table[(h + (unsigned)i) & (unsigned)(S->table_size - 1)];
        if (!slot) return -1;
        if (!strcmp(S->all[slot - 1].item->name, name)) return slot - 1;
    }
    return -1;
}

/* Fills the name table; reports duplicates (the first definition wins). */
static int index_names(sema_state *S)
{
    S->table_size = 16;
    while (S->table_size < 2 * S->n) S->table_size *= 2;
    S->table = kvq_calloc((size_t)S->table_size, sizeof *S->table);
    if (!S->table) return -1;
    for (int i = 0; i < S->n; i++) {
        const ast_item *it = S->all[i].item;
        int prev = find_scheme(S, it->name);
        char b[64];
        if (prev >= 0) {
            const ast_item *p = S->all[prev].item;
            if (S->all[prev].src == S->all[i].src)
                sema_error(S, S->all[i].src, it->name_loc, "duplicate scheme '%s' (the first is at line %d)",
                           sema_q(b, sizeof b, it->name), p->name_loc.line);
            else
                sema_error(S, S->all[i].src, it->name_loc, "duplicate scheme '%s' (the first is in %s, line %d)",
                           sema_q(b, sizeof b, it->name), S->all[prev].src->file, p->name_loc.line);
            continue;
        }
        unsigned h = hash_name(it->name);
        for (int k = 0;; k++) {
            int *slot = &S->table[(h + (unsigned)k) & (unsigned)(S->table_size - 1)];
            if (!*slot) {
                *slot = i + 1;
                break;
            }
        }
    }
    return 0;
}

int sema_reserve_ranges(sema_state *S, sema_scheme *s, int need)
{
    int cap = s->cap_ranges ? s->cap_ranges : 4;
    sema_range *r;
    if (need <= s->cap_ranges) return 1;
    while (cap < need) cap *= 2;
    if (cap > KVQ_MAX_LAYER_RANGES) cap = KVQ_MAX_LAYER_RANGES;
    r = kvq_realloc(s->ranges, (size_t)cap * sizeof *r);
    if (!r) {
        S->nomem = 1;
        return 0;
    }
    s->ranges = r;
    s->cap_ranges = cap;
    return 1;
}

static void start_from(sema_state *S, sema_scheme *s, const sema_scheme *parent)
{
    if (parent) {
        s->model = parent->model;
        s->classify = parent->classify;
        memcpy(s->g, parent->g, sizeof s->g);
        s->base = parent->base;
        if (parent->n_ranges) {
            if (!sema_reserve_ranges(S, s, parent->n_ranges)) return;
            memcpy(s->ranges, parent->ranges, (size_t)parent->n_ranges * sizeof *s->ranges);
            s->n_ranges = parent->n_ranges;
        }
        return;
    }
    memset(&s->model, 0, sizeof s->model);
    sema_default_classify(&s->classify);
    sema_default_layer(&s->base.c);
    for (int f = 0; f < F_COUNT; f++) s->base.p[f] = (sema_prov){NULL, 0, 0, -1, 0};
    for (int g = 0; g < G_COUNT; g++) s->g[g] = (sema_prov){NULL, 0, 0, -1, 0};
}

static void resolve_one(sema_state *S, int i, int parent)
{
    sema_scheme *s = &S->all[i];
    sema_ctx top = {B_SCHEME, RANGE_ALL, 0};
    S->cur = i;
    S->src = s->src;
    start_from(S, s, parent >= 0 ? &S->all[parent] : NULL);
    if (!S->nomem) sema_walk(S, s->item->block, &top);
    if (!S->nomem && !S->dl->stopped) finish(S, s);
    s->state = 2;
}

/* Resolves scheme i and, first, its unresolved ancestors, without recursion. */
static void resolve(sema_state *S, int i)
{
    int *chain, n = 0, cyc_from = -1, j = i;
    char b[64], path[512];
    if (S->all[i].state == 2) return;
    chain = kvq_malloc((size_t)S->n * sizeof *chain);
    if (!chain) {
        S->nomem = 1;
        return;
    }
    /* Walk up to a resolved ancestor, a scheme without parent, an unknown parent or a cycle. */
    for (;;) {
        sema_scheme *s = &S->all[j];
        int p;
        s->state = 1;
        chain[n++] = j;
        if (!s->item->parent) break;
        p = find_scheme(S, s->item->parent);
        if (p < 0) {
            const char *best = NULL;
            int best_d = 3;
            for (int k = 0; k < S->n && !S->dl->stopped; k++) {
                int d = sema_edit_distance(s->item->parent, S->all[k].item->name);
                if (k != j && d < best_d) {
                    best_d = d;
                    best = S->all[k].item->name;
                }
            }
            if (best)
                sema_error(S, s->src, s->item->parent_loc, "unknown parent scheme '%s'; did you mean '%s'?",
                           sema_q(b, sizeof b, s->item->parent), best);
            else
                sema_error(S, s->src, s->item->parent_loc, "unknown parent scheme '%s'",
                           sema_q(b, sizeof b, s->item->parent));
            break;
        }
        if (S->all[p].state == 1) {
            size_t len = 0;
            int from = 0;
            while (chain[from] != p) from++;
            for (int k = from; k < n && len < sizeof path - 80; k++) {
                int w = snprintf(path + len, sizeof path - len, "%s -> ", S->all[chain[k]].item->name);
                if (w > 0) len += (size_t)w;
            }
            snprintf(path + len, sizeof path - len, "%s", S->all[p].item->name);
            sema_error(S, s->src, s->item->parent_loc, "inheritance cycle: %s", path);
            cyc_from = n - 1;
            break;
        }
        if (S->all[p].state == 2) break;
        j = p;
    }
    /* Resolve from the top of the chain down: the top starts from defaults unless its parent is resolved. */
    for (int k = n - 1; k >= 0 && !S->nomem; k--) {
        const sema_scheme *s = &S->all[chain[k]];
        int p = -1;
        if (k < n - 1)
            p = chain[k + 1];
        else if (k != cyc_from && s->item->parent)
            p = find_scheme(S, s->item->parent);
        if (p >= 0 && S->all[p].state != 2) p = -1;
        resolve_one(S, chain[k], p);
    }
    kvq_free(chain);
}

/* ---------------------------------------------------------------------------------------------------------- */

/* keep 0 turns the outlier pool off, its spill pool with it (OTT's shallow layers inherit spill 32). Done on
 * the output only, so a child scheme that turns the pool back on gets the spill the parent asked for. */
static kvq_layer_cfg out_layer(const sema_lcfg *t)
{
    kvq_layer_cfg c = t->c;
    if (c.quant.outliers.keep == 0) c.quant.outliers.spill = 0;
    return c;
}

static void output(const sema_scheme *s, kvq_scheme *out)
{
    memset(out, 0, sizeof *out);
    snprintf(out->name, sizeof out->name, "%s", s->item->name);
    if (s->item->parent) snprintf(out->parent, sizeof out->parent, "%s", s->item->parent);
    snprintf(out->file, sizeof out->file, "%s", s->src->file);
    out->line = s->item->loc.line;
    out->model = s->model;
    out->classify = s->classify;
    out->base = out_layer(&s->base);
    out->n_ranges = s->n_ranges;
    for (int i = 0; i < s->n_ranges; i++) {
        out->ranges[i].lo = s->ranges[i].lo;
        out->ranges[i].hi = s->ranges[i].hi;
        out->ranges[i].cfg = out_layer(&s->ranges[i].cfg);
    }
}

int sema_resolve(diag_list *dl, const sema_decl *decls, int n, kvq_scheme *out)
{
    sema_state S;
    int rc = 0;
    memset(&S, 0, sizeof S);
    S.dl = dl;
    S.n = n;
    if (n == 0) return 0;
    S.all = kvq_calloc((size_t)n, sizeof *S.all);
    if (!S.all) return -1;
    for (int i = 0; i < n; i++) {
        S.all[i].item = decls[i].item;
        S.all[i].src = decls[i].src;
    }
    if (index_names(&S) < 0) S.nomem = 1;
    for (int i = 0; i < n && !S.nomem; i++) resolve(&S, i);
    for (int i = 0; i < n && !S.nomem; i++) output(&S.all[i], &out[i]);
    if (S.nomem) rc = -1;
    for (int i = 0; i < n; i++) kvq_free(S.all[i].ranges);
    kvq_free(S.all);
    kvq_free(S.table);
    return rc;
}
