/* Plan -> CUDA translation unit, C header and manifest: see emit_cuda.h. */
#include "emit_cuda.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "kvq_params.cuh"
#include "lloyd_max.h"
#include "quant.h"

/* build/gen/kvq_templates.c (compiler/embed_templates.sh) */
extern const char *const emit_cuda_template_names[];
extern const char *const emit_cuda_template_texts[];

/* ---- text buffer ---- */

void emit_buf_put(emit_buf *b, const char *s, size_t n)
{
    if (b->failed) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *t = kvq_realloc(b->s, cap);
        if (!t) {
            b->failed = 1;
            return;
        }
        b->s = t;
        b->cap = cap;
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

void emit_buf_printf(emit_buf *b, const char *fmt, ...)
{
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = 1;
        return;
    }
    if ((size_t)n < sizeof small) {
        emit_buf_put(b, small, (size_t)n);
        return;
    }
    char *big = kvq_malloc((size_t)n + 1);
    if (!big) {
        b->failed = 1;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    emit_buf_put(b, big, (size_t)n);
    kvq_free(big);
}

void emit_buf_free(emit_buf *b)
{
    kvq_free(b->s);
    memset(b, 0, sizeof *b);
}

static kvq_status emit_buf_finish(emit_buf *b, char **out, size_t *len)
{
    if (b->failed) {
        emit_buf_free(b);
        *out = NULL;
        return KVQ_ERR_NOMEM;
    }
    if (!b->s) emit_buf_put(b, "", 0);
    if (b->failed) return KVQ_ERR_NOMEM;
    *out = b->s;
    if (len) *len = b->len;
    return KVQ_OK;
}

/* ---- templates ---- */

static const char *template_text(const char *name)
{
    for (int i = 0; emit_cuda_template_names[i]; i++)
        if (strcmp(emit_cuda_template_names[i], name) == 0) return emit_cuda_template_texts[i];
    return NULL;
}

/* Appends a template, dropping its `#include "kvq_*.cuh"` lines: the unit inlines those in dependency order, so
 * NVRTC needs no include path. Other includes (the emulator's header) stay. */
static void put_template(emit_buf *b, const char *name)
{
    const char *t = template_text(name);
    emit_buf_printf(b, "/* ======== templates/%s ======== */\n", name);
    if (!t) {
        b->failed = 1;
        return;
    }
    while (*t) {
        const char *nl = strchr(t, '\n');
        size_t n = nl ? (size_t)(nl - t) + 1 : strlen(t);
        if (strncmp(t, "#include \"kvq_", 14) == 0)
            emit_buf_printf(b, "/* %.*s: inlined */\n", (int)(nl ? (size_t)(nl - t) : n), t);
        else
            emit_buf_put(b, t, n);
        t += n;
    }
}

/* ---- derived sizes ---- */

int emit_cuda_par_floats(const kvq_plan *p, const plan_class *c, int key)
{
    (void)p;
    return key ? c->kpar : c->vpar;
}

int emit_cuda_sbuf_bytes(const kvq_plan *p, const plan_class *c)
{
    (void)p;
    return c->rows_bytes;
}

/* ---- kernels ---- */

static int quantized(const plan_store *st) { return st->bits >= 1 && st->bits <= 8; }

/* A store whose element format takes its tensor scale from the prompt (tensor_scale prompt): kvq_tensor_amax */
static int prompt_scale(const plan_store *st)
{
    return quantized(st) && kvq_format_has_tensor_scale(st->format.kind) && !(st->format.tensor_scale > 0.0f);
}

static void add_kernel(emit_cuda_kernel *out, int *n, int max, const char *name, emit_cuda_kind kind, int cls,
                       const char *params, int param_size, unsigned bx, unsigned by, unsigned bz, const char *grid)
{
    if (*n >= max) return;
    emit_cuda_kernel *k = &out[(*n)++];
    memset(k, 0, sizeof *k);
    snprintf(k->name, sizeof k->name, "%s", name);
    k->kind = kind;
    k->cls = cls;
    k->params = params;
    k->param_size = param_size;
    k->block[0] = bx, k->block[1] = by, k->block[2] = bz;
    k->grid = grid;
}

int emit_cuda_kernels(const kvq_plan *p, emit_cuda_kernel *out, int max)
{
    int n = 0;
    char name[64];
    unsigned mt = p->head_dim < 256 ? (unsigned)p->head_dim : 256;
    const int DP = (int)sizeof(kvq_decode_params), SP = (int)sizeof(kvq_store_params);
    const int GP = (int)sizeof(kvq_sig_params), QP = (int)sizeof(kvq_quant_params);
    const int OP = (int)sizeof(kvq_ott_params), ZP = (int)sizeof(kvq_zip_params);
    const int TP = (int)sizeof(kvq_tk_params), NP = (int)sizeof(kvq_dense_params);
    add_kernel(out, &n, max, "kvq_merge", EMIT_K_MERGE, -1, "kvq_decode_params", DP, mt, 1, 1, "(heads, batch)");
    add_kernel(out, &n, max, "kvq_store_f16", EMIT_K_STORE, -1, "kvq_store_params", SP, 128, 1, 1, "(kv_heads, n)");
    add_kernel(out, &n, max, "kvq_params_sig", EMIT_K_SIG, -1, "kvq_sig_params", GP, 32, 1, 1, "(1)");
    int tamax = 0;
    for (int c = 0; c < p->n_classes; c++)
        tamax |= p->cls[c].quant && (prompt_scale(&p->cls[c].k_hi) || prompt_scale(&p->cls[c].v_hi));
    if (tamax)
        add_kernel(out, &n, max, "kvq_tensor_amax", EMIT_K_STORE, -1, "kvq_tamax_params", (int)sizeof(kvq_tamax_params),
                   128, 1, 1, "(kv_heads)");
    /* policy kernels (kvq_policy.cuh), block KVQ_PTHREADS = 256 */
    if (p->any_pool) {
        add_kernel(out, &n, max, "kvq_ott_compete", EMIT_K_POLICY, -1, "kvq_ott_params", OP, 256, 1, 1, "(kv_heads)");
        add_kernel(out, &n, max, "kvq_ott_undo", EMIT_K_POLICY, -1, "kvq_ott_params", OP, 32, 1, 1, "(kv_heads)");
    }
    if (p->any_saliency) {
        add_kernel(out, &n, max, "kvq_zip_stats_max", EMIT_K_POLICY, -1, "kvq_zip_params", ZP, 256, 1, 1,
                   "(probes, heads, ceil(T / KVQ_ZS_CHUNK))");
        add_kernel(out, &n, max, "kvq_zip_stats", EMIT_K_POLICY, -1, "kvq_zip_params", ZP, 256, 1, 1,
                   "(probes, heads, ceil(T / KVQ_ZS_CHUNK))");
        add_kernel(out, &n, max, "kvq_zip_saliency", EMIT_K_POLICY, -1, "kvq_zip_params", ZP, 256, 1, 1,
                   "(ceil(n / 256), kv_heads)");
        add_kernel(out, &n, max, "kvq_zip_row", EMIT_K_POLICY, -1, "kvq_zip_params", ZP, 256, 1, 1, "(kv_heads)");
        add_kernel(out, &n, max, "kvq_zip_rowsal", EMIT_K_POLICY, -1, "kvq_zip_params", ZP, 256, 1, 1,
                   "(ceil(n / 256), kv_heads)");
        add_kernel(out, &n, max, "kvq_zip_select", EMIT_K_POLICY, -1, "kvq_zip_params", ZP, 256, 1, 1, "(kv_heads)");
    }
    if (p->any_sparse) {
        add_kernel(out, &n, max, "kvq_tk_absmax", EMIT_K_POLICY, -1, "kvq_tk_params", TP, 256, 1, 1,
                   "(kv_heads, KVQ_TK_CHUNKS)");
        add_kernel(out, &n, max, "kvq_tk_score", EMIT_K_POLICY, -1, "kvq_tk_params", TP, 256, 1, 1,
                   "(kv_heads, KVQ_TK_CHUNKS)");
        add_kernel(out, &n, max, "kvq_tk_select", EMIT_K_POLICY, -1, "kvq_tk_params", TP, 256, 1, 1, "(kv_heads)");
    }
    if (p->any_auto)
        add_kernel(out, &n, max, "kvq_tk_dense", EMIT_K_POLICY, -1, "kvq_dense_params", NP, 256, 1, 1, "(n_q)");
    for (int c = 0; c < p->n_classes; c++) {
        const plan_class *pc = &p->cls[c];
        snprintf(name, sizeof name, "kvq_decode_c%d", c);
        add_kernel(out, &n, max, name, EMIT_K_DECODE, c, "kvq_decode_params", DP, (unsigned)p->tx, (unsigned)p->ty,
                   (unsigned)p->tz, "(kv_heads, n_chunks, batch)");
        if (!pc->quant) continue;
        const plan_store *st[4] = {&pc->k_hi, &pc->k_lo, &pc->v_hi, &pc->v_lo};
        const char *sn[4] = {"k_hi", "k_lo", "v_hi", "v_lo"};
        for (int i = 0; i < 4; i++) {
            if (!quantized(st[i])) continue;
            const char *grid = st[i]->gran == KVQ_GRAN_CHANNEL ? "(kv_heads)"
                               : st[i]->hidden                 ? "(1, n)"
                                                               : "(kv_heads, ceil(n / 8))";
            snprintf(name, sizeof name, "kvq_quant_%s_c%d", sn[i], c);
            add_kernel(out, &n, max, name, EMIT_K_QUANT, c, "kvq_quant_params", QP, 128, 1, 1, grid);
        }
        for (int i = 0; i < 4; i++) {
            if (!quantized(st[i]) || !st[i]->sep) continue;
            snprintf(name, sizeof name, "kvq_factor_%s_c%d", sn[i], c);
            add_kernel(out, &n, max, name, EMIT_K_FACTOR, c, "kvq_quant_params", QP, 128, 1, 1, "(kv_heads)");
        }
    }
    return n;
}

/* ---- the translation unit ---- */

/* A TurboQuant store's fields of kvq_fmt (templates/kvq_layout.cuh, kvq_turboquant.cuh): the variant, the outlier
 * split and each part's Lloyd-Max levels of N(0, 1/m) at its MSE bits, the table runtime/turboquant.c quantizes
 * with, printed with 17 significant digits (every double round-trips). */
static void put_tq(emit_buf *b, const plan_store *st)
{
    int qjl = st->tq == KVQ_TQ_PROD, D = st->group; /* a TurboQuant store's group is the head */
    int m[2] = {st->tq_out ? st->tq_out : D, D - st->tq_out};
    int mb[2] = {(st->tq_out ? st->tq_out_bits : st->bits) - qjl, st->bits - qjl};
    emit_buf_printf(b, ", %d, %d, %d, {", st->tq, st->tq_out, st->tq_out ? st->tq_out_bits : 0);
    for (int j = 0; j < 2; j++) {
        double lv[16] = {0};
        if (j == 0 || st->tq_out) kvq_lloyd_max_normal_dim(mb[j], m[j], lv, NULL);
        emit_buf_printf(b, "%s{", j ? ", " : "");
        for (int i = 0; i < 16; i++) emit_buf_printf(b, "%s%.17g", i ? ", " : "", lv[i]);
        emit_buf_printf(b, "}");
    }
    emit_buf_printf(b, "}");
}

static void put_fmt(emit_buf *b, const char *macro, const plan_store *st)
{
    /* kvq_fmt (templates/kvq_layout.cuh); element formats: their scale/zero bytes (1: e4m3/e8m0, 0: none), the
     * kind, the tensor scale and a codebook's levels (templates/kvq_format.cuh) */
    const kvq_format_cfg *f = &st->format;
    int fmt = st->bits < 16 && f->kind != KVQ_FMT_INT;
    kvq_param_dtype sdt = st->scale_f32 ? KVQ_DT_FP32 : KVQ_DT_FP16, zdt = st->zero_f32 ? KVQ_DT_FP32 : KVQ_DT_FP16;
    if (st->bits < 16 && st->tq) sdt = zdt = KVQ_DT_FP32; /* TurboQuant's norms (layout.c) */
    emit_buf_printf(b, "#define %s {%d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %d, %.9g, %d, {", macro, st->bits, st->gran,
                    st->sep, st->group, st->hidden, fmt ? kvq_format_scale_bytes(f->kind, sdt) : sdt == KVQ_DT_FP32 ? 4 : 2,
                    fmt ? kvq_format_zero_bytes(f->kind, zdt) : zdt == KVQ_DT_FP32 ? 4 : 2, st->masked, fmt ? (int)f->kind : 0,
                    fmt ? f->tensor_scale_per_head : 0, fmt ? f->codebook_normal : 0, fmt && f->tensor_scale > 0 ? (double)f->tensor_scale : 0.0,
                    fmt ? f->n_levels : 0);
    for (int i = 0; i < 16; i++)
        emit_buf_printf(b, "%s%#.9gf", i ? ", " : "", fmt && i < f->n_levels ? (double)f->levels[i] : 0.0);
    emit_buf_printf(b, "}");
    if (st->bits < 16 && st->tq) put_tq(b, st);
    emit_buf_printf(b, "}\n");
}

static void describe_store(emit_buf *b, const char *what, const plan_store *st)
{
    if (st->bits == 0) return;
    if (st->bits >= 16) {
        emit_buf_printf(b, " *   %s: fp16\n", what);
        return;
    }
    emit_buf_printf(b, " *   %s: %d-bit%s%s, per %s", what, st->bits, st->format.kind != KVQ_FMT_INT ? " " : "",
                    st->format.kind != KVQ_FMT_INT ? kvq_format_name(st->format.kind) : "",
                    st->gran == KVQ_GRAN_CHANNEL ? "channel" : "token");
    if (st->tq) emit_buf_printf(b, ", turboquant %s", st->tq == KVQ_TQ_PROD ? "prod" : "mse");
    if (st->tq && st->tq_out) emit_buf_printf(b, ", outlier_channels %d bits %d", st->tq_out, st->tq_out_bits);
    if (st->hidden)
        emit_buf_printf(b, ", group hidden");
    else if (st->group)
        emit_buf_printf(b, ", group %d", st->group);
    else
        emit_buf_printf(b, ", group all");
    emit_buf_printf(b, "%s%s, scale %s, zero %s\n", st->sep ? ", channel-separable" : "", st->masked ? ", masked" : "",
                    st->scale_f32 ? "fp32" : "fp16", st->zero_f32 ? "fp32" : "fp16");
}

static void layer_list(emit_buf *b, const kvq_plan *p, int c)
{
    int first = 1;
    for (int l = 0; l < p->layers; l++) {
        if (p->layer_class[l] != c) continue;
        int e = l;
        while (e + 1 < p->layers && p->layer_class[e + 1] == c) e++;
        emit_buf_printf(b, "%s%d", first ? "" : ",", l);
        if (e > l) emit_buf_printf(b, "-%d", e);
        first = 0;
        l = e;
    }
}

static const char *mode_name(kvq_layer_mode m)
{
    return m == KVQ_MODE_QUANT ? "quantize" : m == KVQ_MODE_SPARSE ? "sparse" : "auto";
}

static void put_class(emit_buf *b, const kvq_plan *p, const plan_class *c)
{
    plan_store f16 = {.bits = 16}, none = {.bits = 0};
    emit_buf_printf(b, "\n/* ======== layer class %d (%s): layers ", c->id, mode_name(c->mode));
    layer_list(b, p, c->id);
    emit_buf_printf(b, " ========\n");
    if (c->quant) {
        describe_store(b, "keys", &c->k_hi);
        describe_store(b, "keys, low class", &c->k_lo);
        describe_store(b, "values", &c->v_hi);
        describe_store(b, "values, low class", &c->v_lo);
        emit_buf_printf(b, " *   sinks %d, residual %d, key window %d+%d, value window %d+%d, pool %d, spill %d\n",
                        c->q.sinks, c->q.residual, c->rule_k.keep, c->rule_k.batch, c->rule_v.keep, c->rule_v.batch,
                        c->has_pool ? c->q.outliers.keep : 0, c->has_spill ? c->q.outliers.spill : 0);
    }
    if (c->sparse)
        emit_buf_printf(b, " *   sparse: sinks %d, recent %d, top-k %d, critical channels %d\n", c->sp.sinks,
                        c->sp.recent, c->sp.topk, c->sp.critical_channels);
    emit_buf_printf(b, " */\n#define KVQ_C(name) name##_c%d\n", c->id);
    emit_buf_printf(b, "#define KVQ_C_TILE %d\n#define KVQ_C_KROW %d\n#define KVQ_C_VROW %d\n", c->tile, c->k_row_bytes,
                    c->v_row_bytes);
    emit_buf_printf(b, "#define KVQ_C_KPAR %d\n#define KVQ_C_VPAR %d\n#define KVQ_C_SBUF %d\n",
                    emit_cuda_par_floats(p, c, 1), emit_cuda_par_floats(p, c, 0), emit_cuda_sbuf_bytes(p, c));
    emit_buf_printf(b, "#define KVQ_C_SPLIT %d\n#define KVQ_C_P1 %d\n", c->split, c->p1);
    emit_buf_printf(b, "#define KVQ_C_KPAGES %d\n", c->kpages); /* key pages a tile spans (layout/tiles.h) */
    emit_buf_printf(b, "#define KVQ_C_VOFF %d\n", c->rows_k); /* the value rows' offset in the row buffer */
    emit_buf_printf(b, "#define KVQ_C_MINB %d\n", plan_decode_min_blocks(p, c)); /* ptxas's register cap */
    emit_buf_printf(b,
                    "#define KVQ_C_SMEM %d /* dynamic shared memory: rows %d, kpar %d, vpar %d, kmask %d, q %d, qk %d, "
                    "qsum %d, p %d, red %d */\n",
                    c->smem, c->so_rows, c->so_kpar, c->so_vpar, c->so_kmask, c->so_q, c->so_qk, c->so_qsum, c->so_p,
                    c->so_red);
    emit_buf_printf(b,
                    "#define KVQ_C_SO_KPAR %d\n#define KVQ_C_SO_VPAR %d\n#define KVQ_C_SO_KMASK %d\n"
                    "#define KVQ_C_SO_Q %d\n#define KVQ_C_SO_QK %d\n#define KVQ_C_SO_QSUM %d\n#define KVQ_C_SO_P %d\n"
                    "#define KVQ_C_SO_RED %d\n#define KVQ_C_SO_W %d\n",
                    c->so_kpar, c->so_vpar, c->so_kmask, c->so_q, c->so_qk, c->so_qsum, c->so_p, c->so_red, c->so_w);
    /* the load pipeline: stages of the staged part, raw parameter bytes (plan.h) */
    emit_buf_printf(b,
                    "#define KVQ_C_STAGES %d\n#define KVQ_C_STAGE_BYTES %d\n#define KVQ_C_SO_KRAW %d\n"
                    "#define KVQ_C_SO_VRAW %d\n#define KVQ_C_KRAWS %d\n#define KVQ_C_VRAWS %d\n#define KVQ_C_RAWF %d\n"
                    "#define KVQ_C_PAR_STEP %d\n",
                    c->stages, c->stage_bytes, c->so_kraw, c->so_vraw, c->kraws, c->vraws, c->rawf, c->par_step);
    /* the tensor-core paths (kvq_mma.cuh): bit 0 the high class's pages, bit 1 the low class's */
    emit_buf_printf(b, "#define KVQ_C_MMA_K %d\n#define KVQ_C_MMA_V %d\n", c->mma_k, c->mma_v);
    /* parameters read where cp.async lands them, not widened (plan.h: kpraw, vpraw) */
    emit_buf_printf(b, "#define KVQ_C_KPRAW %d\n#define KVQ_C_VPRAW %d\n", c->kpraw, c->vpraw);
    const plan_store *st[4] = {&c->k_hi, &c->k_lo, &c->v_hi, &c->v_lo};
    const char *mn[4] = {"KVQ_C_KHI", "KVQ_C_KLO", "KVQ_C_VHI", "KVQ_C_VLO"};
    for (int i = 0; i < 4; i++) {
        /* a sparse-only class attends over fp16 rows: its "pages" are fp16 */
        const plan_store *s = c->quant ? st[i] : (i % 2 == 0 ? &f16 : &none);
        char m[32];
        put_fmt(b, mn[i], s);
        snprintf(m, sizeof m, "%s_Q", mn[i]);
        emit_buf_printf(b, "#define %s %d\n", m, quantized(s));
        snprintf(m, sizeof m, "%s_SEP", mn[i]);
        emit_buf_printf(b, "#define %s %d\n", m, quantized(s) && s->sep);
    }
    put_template(b, "kvq_class.cuh");
    emit_buf_printf(b, "#undef KVQ_C\n#undef KVQ_C_TILE\n#undef KVQ_C_KROW\n#undef KVQ_C_VROW\n"
                       "#undef KVQ_C_KPAR\n#undef KVQ_C_VPAR\n#undef KVQ_C_SBUF\n#undef KVQ_C_SPLIT\n#undef KVQ_C_P1\n#undef KVQ_C_MINB\n"
                       "#undef KVQ_C_KPAGES\n#undef KVQ_C_VOFF\n"
                       "#undef KVQ_C_SMEM\n#undef KVQ_C_SO_KPAR\n#undef KVQ_C_SO_VPAR\n#undef KVQ_C_SO_KMASK\n"
                       "#undef KVQ_C_SO_Q\n#undef KVQ_C_SO_QK\n#undef KVQ_C_SO_QSUM\n#undef KVQ_C_SO_P\n"
                       "#undef KVQ_C_SO_RED\n#undef KVQ_C_SO_W\n#undef KVQ_C_MMA_K\n#undef KVQ_C_MMA_V\n#undef KVQ_C_KPRAW\n#undef KVQ_C_VPRAW\n"
                       "#undef KVQ_C_STAGES\n#undef KVQ_C_STAGE_BYTES\n#undef KVQ_C_SO_KRAW\n#undef KVQ_C_SO_VRAW\n"
                       "#undef KVQ_C_KRAWS\n#undef KVQ_C_VRAWS\n#undef KVQ_C_RAWF\n#undef KVQ_C_PAR_STEP\n");
    for (int i = 0; i < 4; i++) emit_buf_printf(b, "#undef %s\n#undef %s_Q\n#undef %s_SEP\n", mn[i], mn[i], mn[i]);
}

/* 1 when a layer class stores a page in an element format (put_fmt's test). */
static int any_format(const kvq_plan *p)
{
    for (int c = 0; c < p->n_classes; c++) {
        const plan_class *k = &p->cls[c];
        const plan_store *st[4] = {&k->k_hi, &k->k_lo, &k->v_hi, &k->v_lo};
        for (int i = 0; k->quant && i < 4; i++)
            if (st[i]->bits < 16 && st[i]->format.kind != KVQ_FMT_INT) return 1;
    }
    return 0;
}

/* 1 when a layer class stores TurboQuant codes. */
static int any_tq(const kvq_plan *p)
{
    for (int c = 0; c < p->n_classes; c++) {
        const plan_class *k = &p->cls[c];
        const plan_store *st[4] = {&k->k_hi, &k->k_lo, &k->v_hi, &k->v_lo};
        for (int i = 0; k->quant && i < 4; i++)
            if (st[i]->bits < 16 && st[i]->tq) return 1;
    }
    return 0;
}

static const char *dtype_name(int dt) { return dt == KVQ_F16 ? "fp16" : dt == KVQ_BF16 ? "bf16" : "fp32"; }

kvq_status emit_cuda_source(const kvq_plan *p, char **out, size_t *len)
{
    emit_buf b = {0};
    emit_buf_printf(&b,
                    "/* Generated by kvq (%s) from scheme '%s': do not edit; regenerate with `make generated`.\n"
                    " * Model: %d layers, %d heads, %d kv heads, head_dim %d; inputs %s.\n"
                    " * One translation unit: the plan's constants, then templates/ inlined, then one block of\n"
                    " * entry points per layer class. Compiles with NVRTC (sm_80+) or, for the emulator, with a\n"
                    " * host C++ compiler and -I tests/emu. */\n",
                    EMIT_CUDA_KVQ_VERSION, p->scheme, p->layers, p->heads, p->kv_heads, p->head_dim,
                    dtype_name(p->in_dtype));
    emit_buf_printf(&b, "#define KVQ_D %d\n#define KVQ_HQ %d\n#define KVQ_HKV %d\n#define KVQ_GQA %d\n", p->head_dim,
                    p->heads, p->kv_heads, p->gqa);
    emit_buf_printf(&b, "#define KVQ_IN_DTYPE %d /* 0 fp32, 1 fp16, 2 bf16 */\n", p->in_dtype);
    emit_buf_printf(&b,
                    "/* decode block: TX lanes x VEC channels, TY lanes x HPT query heads, TZ token lanes */\n"
                    "#define KVQ_VEC %d\n#define KVQ_TX %d\n#define KVQ_TY %d\n#define KVQ_HPT %d\n"
                    "#define KVQ_TZ %d\n#define KVQ_THREADS %d\n",
                    p->vec, p->tx, p->ty, p->hpt, p->tz, p->threads);
    /* Resident blocks the decode kernel asks ptxas to allow: caps it at 128 registers, which ptxas otherwise
     * undercuts (64) and spills at. */
    emit_buf_printf(&b, "#define KVQ_MIN_BLOCKS %d\n", p->threads >= 512 ? 1 : 512 / p->threads);
    /* policy kernels (kvq_policy.cuh): only the sections the plan's policies need */
    emit_buf_printf(&b, "#define KVQ_POL_OTT %d\n#define KVQ_POL_ZIP %d\n", p->any_pool, p->any_saliency);
    emit_buf_printf(&b, "#define KVQ_POL_TK %d\n#define KVQ_POL_DENSE %d\n", p->any_sparse, p->any_auto);
    /* element formats (kvq_format.cuh): their device code only in a unit that has one */
    emit_buf_printf(&b, "#define KVQ_FMT_ANY %d\n", any_format(p));
    /* TurboQuant pages (kvq_turboquant.cuh): likewise */
    emit_buf_printf(&b, "#define KVQ_TQ_ANY %d\n", any_tq(p));
    static const char *const common[] = {"kvq_intrin.cuh", "kvq_params.cuh", "kvq_layout.cuh",   "kvq_types.cuh",
                                         "kvq_format.cuh", "kvq_turboquant.cuh", "kvq_unpack.cuh", "kvq_mma.cuh", "kvq_decode.cuh", "kvq_quantize.cuh", "kvq_common.cuh"};
    for (size_t i = 0; i < sizeof common / sizeof common[0]; i++) put_template(&b, common[i]);
    if (p->any_pool || p->any_saliency || p->any_sparse || p->any_auto) {
        put_template(&b, "kvq_select.cuh");
        put_template(&b, "kvq_policy.cuh");
    }
    for (int c = 0; c < p->n_classes; c++) put_class(&b, p, &p->cls[c]);
    return emit_buf_finish(&b, out, len);
}

/* ---- header and manifest ---- */

static void upper_ident(char *dst, size_t n, const char *s)
{
    size_t i = 0;
    for (; s[i] && i + 1 < n; i++) {
        char ch = s[i];
        if (ch >= 'a' && ch <= 'z') ch = (char)(ch - 'a' + 'A');
        if (!((ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9'))) ch = '_';
        dst[i] = ch;
    }
    dst[i] = 0;
}

kvq_status emit_cuda_header(const kvq_plan *p, const char *hash, char **out, size_t *len)
{
    emit_buf b = {0};
    char up[KVQ_NAME_MAX + 8], lo[KVQ_NAME_MAX + 8];
    upper_ident(up, sizeof up, p->scheme);
    snprintf(lo, sizeof lo, "%s", up);
    for (char *s = lo; *s; s++)
        if (*s >= 'A' && *s <= 'Z') *s = (char)(*s - 'A' + 'a');
    emit_cuda_kernel ks[EMIT_CUDA_MAX_KERNELS];
    int nk = emit_cuda_kernels(p, ks, EMIT_CUDA_MAX_KERNELS);
    emit_buf_printf(&b,
                    "/* Generated by kvq (%s) from scheme '%s': do not edit.\n"
                    " * What a host program needs to launch the kernels of kernels.cu (cubins and PTX beside it):\n"
                    " * the parameter structs (each kernel takes one by value), the plan's constants, the kernel\n"
                    " * table and the layer -> class map. Source SHA-256: %s */\n",
                    EMIT_CUDA_KVQ_VERSION, p->scheme, hash ? hash : "");
    emit_buf_printf(&b, "#ifndef KVQ_GEN_%s_H\n#define KVQ_GEN_%s_H\n\n", up, up);
    put_template(&b, "kvq_params.cuh");
    emit_buf_printf(&b, "\n#define KVQ_%s_SOURCE_SHA256 \"%s\"\n", up, hash ? hash : "");
    emit_buf_printf(&b, "#define KVQ_%s_LAYERS %d\n#define KVQ_%s_HEADS %d\n#define KVQ_%s_KV_HEADS %d\n", up,
                    p->layers, up, p->heads, up, p->kv_heads);
    emit_buf_printf(&b, "#define KVQ_%s_HEAD_DIM %d\n#define KVQ_%s_CLASSES %d\n#define KVQ_%s_KERNELS %d\n\n", up,
                    p->head_dim, up, p->n_classes, up, nk);
    emit_buf_printf(&b,
                    "typedef struct {\n    const char *name;   /* entry point (extern \"C\") */\n"
                    "    const char *params; /* its parameter struct */\n    int param_size;\n"
                    "    int layer_class;    /* -1: common to every class */\n"
                    "    unsigned block[3];\n    const char *grid;   /* grid dimensions */\n"
                    "} kvq_%s_kernel;\n\n",
                    lo);
    emit_buf_printf(&b, "static const kvq_%s_kernel kvq_%s_kernels[%d] = {\n", lo, lo, nk);
    for (int i = 0; i < nk; i++)
        emit_buf_printf(&b, "    {\"%s\", \"%s\", %d, %d, {%u, %u, %u}, \"%s\"},\n", ks[i].name, ks[i].params,
                        ks[i].param_size, ks[i].cls, ks[i].block[0], ks[i].block[1], ks[i].block[2], ks[i].grid);
    emit_buf_printf(&b, "};\n\nstatic const unsigned char kvq_%s_layer_class[%d] = {", lo, p->layers);
    for (int l = 0; l < p->layers; l++) emit_buf_printf(&b, "%s%d", l % 32 ? ", " : "\n    ", p->layer_class[l]);
    emit_buf_printf(&b, "\n};\n\n#endif\n");
    return emit_buf_finish(&b, out, len);
}

static void json_store(emit_buf *b, const char *key, const plan_store *st)
{
    emit_buf_printf(b,
                    "\"%s\": {\"bits\": %d, \"gran\": \"%s\", \"group\": %d, \"hidden\": %d, \"separable\": %d, "
                    "\"scale\": \"%s\", \"zero\": \"%s\", \"masked\": %d}",
                    key, st->bits, st->gran == KVQ_GRAN_CHANNEL ? "channel" : "token", st->group, st->hidden, st->sep,
                    st->scale_f32 ? "fp32" : "fp16", st->zero_f32 ? "fp32" : "fp16", st->masked);
}

kvq_status emit_cuda_manifest(const kvq_plan *p, const char *hash, const char *resources, char **out, size_t *len)
{
    emit_buf b = {0};
    emit_cuda_kernel ks[EMIT_CUDA_MAX_KERNELS];
    int nk = emit_cuda_kernels(p, ks, EMIT_CUDA_MAX_KERNELS);
    emit_buf_printf(&b, "{\n  \"generator\": \"%s\",\n  \"scheme\": \"%s\",\n  \"source\": \"kernels.cu\",\n",
                    EMIT_CUDA_KVQ_VERSION, p->scheme);
    emit_buf_printf(&b, "  \"source_sha256\": \"%s\",\n", hash ? hash : "");
    emit_buf_printf(&b,
                    "  \"model\": {\"layers\": %d, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"input\": "
                    "\"%s\"},\n",
                    p->layers, p->heads, p->kv_heads, p->head_dim, dtype_name(p->in_dtype));
    emit_buf_printf(&b,
                    "  \"decode_block\": {\"vec\": %d, \"tx\": %d, \"ty\": %d, \"hpt\": %d, \"tz\": %d, \"threads\": "
                    "%d},\n",
                    p->vec, p->tx, p->ty, p->hpt, p->tz, p->threads);
    emit_buf_printf(&b, "  \"layer_class\": [");
    for (int l = 0; l < p->layers; l++) emit_buf_printf(&b, "%s%d", l ? ", " : "", p->layer_class[l]);
    emit_buf_printf(&b, "],\n  \"classes\": [\n");
    for (int c = 0; c < p->n_classes; c++) {
        const plan_class *pc = &p->cls[c];
        emit_buf_printf(&b,
                        "    {\"id\": %d, \"mode\": \"%s\", \"tile\": %d, \"sbuf_bytes\": %d, \"split\": %d, "
                        "\"decode_smem\": %d",
                        c, mode_name(pc->mode), pc->tile, emit_cuda_sbuf_bytes(p, pc), pc->split, pc->smem);
        if (pc->quant) {
            emit_buf_printf(&b, ",\n     ");
            json_store(&b, "k_hi", &pc->k_hi);
            emit_buf_printf(&b, ",\n     ");
            json_store(&b, "v_hi", &pc->v_hi);
            if (pc->has_low) {
                emit_buf_printf(&b, ",\n     ");
                json_store(&b, "k_lo", &pc->k_lo);
                emit_buf_printf(&b, ",\n     ");
                json_store(&b, "v_lo", &pc->v_lo);
            }
            emit_buf_printf(&b,
                            ",\n     \"sinks\": %d, \"residual\": %d, \"key_window\": [%d, %d], \"value_window\": "
                            "[%d, %d], \"pool\": %d, \"spill\": %d",
                            pc->q.sinks, pc->q.residual, pc->rule_k.keep, pc->rule_k.batch, pc->rule_v.keep,
                            pc->rule_v.batch, pc->has_pool ? pc->q.outliers.keep : 0,
                            pc->has_spill ? pc->q.outliers.spill : 0);
        }
        if (pc->sparse)
            emit_buf_printf(&b, ",\n     \"sparse\": {\"sinks\": %d, \"recent\": %d, \"topk\": %d, \"channels\": %d}",
                            pc->sp.sinks, pc->sp.recent, pc->sp.topk, pc->sp.critical_channels);
        emit_buf_printf(&b, "}%s\n", c + 1 < p->n_classes ? "," : "");
    }
    emit_buf_printf(&b, "  ],\n  \"kernels\": [\n");
    for (int i = 0; i < nk; i++)
        emit_buf_printf(&b,
                        "    {\"name\": \"%s\", \"class\": %d, \"params\": \"%s\", \"param_size\": %d, \"block\": "
                        "[%u, %u, %u], \"grid\": \"%s\"}%s\n",
                        ks[i].name, ks[i].cls, ks[i].params, ks[i].param_size, ks[i].block[0], ks[i].block[1],
                        ks[i].block[2], ks[i].grid, i + 1 < nk ? "," : "");
    emit_buf_printf(&b, "  ]");
    if (resources) emit_buf_printf(&b, ",\n  \"resources\": %s", resources);
    emit_buf_printf(&b, "\n}\n");
    return emit_buf_finish(&b, out, len);
}

void emit_cuda_text_free(emit_cuda_text *t)
{
    kvq_free(t->source);
    kvq_free(t->header);
    kvq_free(t->manifest);
    memset(t, 0, sizeof *t);
}

kvq_status emit_cuda_text_build(const kvq_plan *p, const char *resources, emit_cuda_text *t)
{
    memset(t, 0, sizeof *t);
    kvq_status st = emit_cuda_source(p, &t->source, &t->source_len);
    if (st == KVQ_OK) {
        emit_cuda_sha256_hex(t->source, t->source_len, t->hash);
        st = emit_cuda_header(p, t->hash, &t->header, &t->header_len);
    }
    if (st == KVQ_OK) st = emit_cuda_manifest(p, t->hash, resources, &t->manifest, &t->manifest_len);
    if (st != KVQ_OK) emit_cuda_text_free(t);
    return st;
}

/* ---- SHA-256 (FIPS 180-4) ---- */

static const uint32_t sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return x >> n | x << (32 - n); }

static void sha_block(uint32_t h[8], const unsigned char *p)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = hh + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + sha_k[i] + w[i];
        uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
}

void emit_cuda_sha256(const void *data, size_t n, unsigned char out[32])
{
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    const unsigned char *p = data;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) sha_block(h, p + i);
    unsigned char tail[128] = {0};
    size_t r = n - i;
    if (r) memcpy(tail, p + i, r);
    tail[r] = 0x80;
    size_t tl = r + 9 <= 64 ? 64 : 128;
    uint64_t bits = (uint64_t)n * 8;
    for (int k = 0; k < 8; k++) tail[tl - 1 - k] = (unsigned char)(bits >> (8 * k));
    sha_block(h, tail);
    if (tl == 128) sha_block(h, tail + 64);
    for (int k = 0; k < 8; k++)
        for (int j = 0; j < 4; j++) out[4 * k + j] = (unsigned char)(h[k] >> (24 - 8 * j));
}

void emit_cuda_sha256_hex(const void *data, size_t n, char out[65])
{
    unsigned char d[32];
    emit_cuda_sha256(data, n, d);
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}
