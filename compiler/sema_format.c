/* Element formats in the spec language: the `format` and `tensor_scale` statements and the checks of a
 * resolved tensor's format (docs/language.md, "Element formats"). Kept apart from sema_stmt.c so that the
 * format axis is one file. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lloyd_max.h"
#include "quant.h"
#include "sema_int.h"

static const struct {
    const char *name;
    kvq_format_kind kind;
} NAMES[] = {
    {"int", KVQ_FMT_INT},     {"q8_0", KVQ_FMT_Q8_0},   {"q4_0", KVQ_FMT_Q4_0},   {"q4_1", KVQ_FMT_Q4_1},
    {"q5_0", KVQ_FMT_Q5_0},   {"q5_1", KVQ_FMT_Q5_1},   {"e4m3", KVQ_FMT_E4M3},   {"e5m2", KVQ_FMT_E5M2},
    {"nvfp4", KVQ_FMT_NVFP4}, {"mxfp4", KVQ_FMT_MXFP4}, {"codebook", KVQ_FMT_CODEBOOK},
};
#define N_NAMES ((int)(sizeof NAMES / sizeof NAMES[0]))

static int is_ggml(kvq_format_kind k) { return k >= KVQ_FMT_Q8_0 && k <= KVQ_FMT_Q5_1; }
static int is_fp8(kvq_format_kind k) { return k == KVQ_FMT_E4M3 || k == KVQ_FMT_E5M2; }

static const ast_arg *nth(const ast_stmt *st, int i)
{
    const ast_arg *a = st->args;
    while (a && i-- > 0) a = a->next;
    return a;
}

void sema_h_format(sema_state *S, const ast_stmt *st, const sema_ctx *c, const struct stmt_def *d)
{
    const ast_arg *a = st->args;
    kvq_format_cfg f;
    char b[64];
    int k = -1;
    (void)d;
    memset(&f, 0, sizeof f);
    if (a->kind == AST_IDENT)
        for (int i = 0; i < N_NAMES; i++)
            if (!strcmp(a->text, NAMES[i].name)) k = i;
    if (k < 0) {
        const char *best = NULL;
        int bd = 3;
        for (int i = 0; i < N_NAMES && a->kind == AST_IDENT; i++) {
            int dist = sema_edit_distance(a->text, NAMES[i].name);
            if (dist < bd) {
                bd = dist;
                best = NAMES[i].name;
            }
        }
        if (best)
            ERR(a->loc, "unknown format '%s'; did you mean '%s'?", sema_q(b, sizeof b, a->text), best);
        else
            ERR(a->loc,
                "format must be int, q8_0, q4_0, q4_1, q5_0, q5_1, e4m3, e5m2, nvfp4, mxfp4 or codebook, not '%s'",
                sema_q(b, sizeof b, a->text));
        return;
    }
    f.kind = NAMES[k].kind;
    if (f.kind == KVQ_FMT_INT) {
        if (st->n_args > 2) {
            ERR(nth(st, 2)->loc, "unexpected '%s' (usage: format int [symmetric|asymmetric])",
                sema_q(b, sizeof b, nth(st, 2)->text));
            return;
        }
        if (st->n_args == 2) {
            const ast_arg *m = nth(st, 1);
            if (m->kind == AST_IDENT && !strcmp(m->text, "symmetric"))
                f.kind = KVQ_FMT_INT_SYM;
            else if (!(m->kind == AST_IDENT && !strcmp(m->text, "asymmetric"))) {
                ERR(m->loc, "format int is 'symmetric' or 'asymmetric', not '%s'", sema_q(b, sizeof b, m->text));
                return;
            }
        }
    } else if (f.kind == KVQ_FMT_CODEBOOK) {
        const ast_arg *m = nth(st, 1);
        if (!m) {
            ERR(st->loc, "codebook needs its levels: 'codebook normal' or 'codebook L1 L2 ...'");
            return;
        }
        if (m->kind == AST_IDENT && !strcmp(m->text, "normal")) {
            if (st->n_args > 2) {
                ERR(nth(st, 2)->loc, "unexpected '%s' (usage: format codebook normal)",
                    sema_q(b, sizeof b, nth(st, 2)->text));
                return;
            }
            f.codebook_normal = 1;
        } else {
            for (; m; m = m->next) {
                if (m->kind != AST_INT && m->kind != AST_REAL) {
                    ERR(m->loc, "a codebook level must be a number, not '%s'", sema_q(b, sizeof b, m->text));
                    return;
                }
                if (f.n_levels == KVQ_CODEBOOK_MAX) {
                    ERR(m->loc, "a codebook has at most %d levels (bits 4)", KVQ_CODEBOOK_MAX);
                    return;
                }
                if (!isfinite(m->num) || fabs(m->num) > 65504) {
                    ERR(m->loc, "codebook level '%s' is out of range (at most 65504 in magnitude)",
                        sema_q(b, sizeof b, m->text));
                    return;
                }
                /* Kept ascending: insertion, and a repeated level is a mistake. */
                float v = (float)m->num;
                int at = f.n_levels;
                while (at > 0 && f.levels[at - 1] > v) at--;
                if ((at > 0 && f.levels[at - 1] == v)) {
                    ERR(m->loc, "codebook level '%s' is given twice", sema_q(b, sizeof b, m->text));
                    return;
                }
                memmove(&f.levels[at + 1], &f.levels[at], (size_t)(f.n_levels - at) * sizeof f.levels[0]);
                f.levels[at] = v;
                f.n_levels++;
            }
            if (f.levels[0] == 0 && f.levels[f.n_levels - 1] == 0) {
                ERR(nth(st, 1)->loc, "a codebook needs a nonzero level (its scale is absmax / max |level|)");
                return;
            }
        }
    } else if (st->n_args > 1) {
        ERR(nth(st, 1)->loc, "unexpected '%s' (format %s takes no arguments)", sema_q(b, sizeof b, nth(st, 1)->text),
            NAMES[k].name);
        return;
    }
    sema_put_format(S, c, &f, st->loc);
    /* The named formats fix what their stored blocks are: the code width, per token, the block, an fp16 scale
     * for ggml's. A later statement that contradicts one of them is reported by sema_check_format. */
    if (f.kind != KVQ_FMT_INT && f.kind != KVQ_FMT_INT_SYM && f.kind != KVQ_FMT_CODEBOOK) {
        sema_put_tensor(S, c, T_BITS, kvq_format_code_bits(&f, 16), st->loc);
        sema_put_tensor(S, c, T_GRAN, KVQ_GRAN_TOKEN, st->loc);
        if (kvq_format_block(f.kind)) sema_put_tensor(S, c, T_GROUP, kvq_format_block(f.kind), st->loc);
        if (is_ggml(f.kind)) sema_put_tensor(S, c, T_SCALE, 0, st->loc);
    }
}

void sema_h_tensor_scale(sema_state *S, const ast_stmt *st, const sema_ctx *c, const struct stmt_def *d)
{
    const ast_arg *a = st->args;
    char b[64];
    (void)d;
    if (a->kind == AST_IDENT && !strcmp(a->text, "prompt")) {
        const ast_arg *p1 = a->next, *p2 = p1 ? p1->next : NULL;
        if (!p1) {
            sema_put_tensor(S, c, T_TSCALE, KVQ_TENSOR_SCALE_PROMPT, st->loc);
            return;
        }
        if (p1->kind == AST_IDENT && !strcmp(p1->text, "per") && p2 && p2->kind == AST_IDENT &&
            !strcmp(p2->text, "head") && !p2->next) {
            sema_put_tensor(S, c, T_TSCALE, KVQ_TENSOR_SCALE_PROMPT_PER_HEAD, st->loc);
            return;
        }
        if (p1->kind == AST_IDENT && !strcmp(p1->text, "per") && p2 && !p2->next)
            ERR(p2->loc,
                "a tensor scale is per tensor or 'per head', not per '%s' (scales per token or per group are the "
                "groups': per token; group N)",
                sema_q(b, sizeof b, p2->text));
        else
            ERR(p1->loc, "unexpected '%s' (usage: tensor_scale X | prompt [per head])", sema_q(b, sizeof b, p1->text));
        return;
    }
    if (st->n_args > 1) {
        ERR(a->next->loc, "unexpected '%s' (usage: tensor_scale X | prompt [per head])",
            sema_q(b, sizeof b, a->next->text));
        return;
    }
    if ((a->kind == AST_INT || a->kind == AST_REAL) && a->num > 0 && a->num <= 3.4e38 && (float)a->num > 0) {
        sema_put_tensor(S, c, T_TSCALE, a->num, st->loc);
        return;
    }
    ERR(a->loc, "tensor_scale must be a positive number or 'prompt', not '%s'", sema_q(b, sizeof b, a->text));
}

static const char *group_text(char *buf, size_t n, int g)
{
    if (g == KVQ_GROUP_ALL) return "all";
    if (g == KVQ_GROUP_HIDDEN) return "hidden";
    snprintf(buf, n, "%d", g);
    return buf;
}

void sema_check_format(sema_state *S, const sema_scheme *s, const sema_lcfg *t, int key)
{
    const kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
    const int F = key ? F_KEY : F_VALUE;
    const char *name = key ? "keys" : "values";
    const sema_prov *pf = &t->p[F + T_FORMAT], *b;
    kvq_format_kind k = x->format.kind;
    const char *fn = kvq_format_name(k);
    int block = kvq_format_block(k), cb = kvq_format_code_bits(&x->format, x->bits), hd = s->model.head_dim;
    char g1[16];

    if (k != KVQ_FMT_INT && k != KVQ_FMT_INT_SYM && k != KVQ_FMT_CODEBOOK && x->bits != cb &&
        (b = BLAME(&t->p[F + T_BITS], pf)))
        sema_error(S, b->src, sema_prov_loc(b), "format %s stores %d-bit codes, but the %s have bits %d", fn, cb, name,
                   x->bits);
    if ((block || is_fp8(k)) && x->gran != KVQ_GRAN_TOKEN && (b = BLAME(&t->p[F + T_GRAN], pf)))
        sema_error(S, b->src, sema_prov_loc(b),
                   "format %s quantizes the channels of one token (per token), but the %s are per channel", fn, name);
    if (block && x->group != block && (b = BLAME(&t->p[F + T_GROUP], pf)))
        sema_error(S, b->src, sema_prov_loc(b), "format %s scales blocks of %d channels, but the %s group is %s", fn,
                   block, name, group_text(g1, sizeof g1, x->group));
    else if (block && hd > 0 && hd % block && (b = BLAME(pf, &s->g[G_HEAD_DIM])))
        sema_error(S, b->src, sema_prov_loc(b), "format %s's block of %d channels does not divide head_dim %d", fn,
                   block, hd);
    if (is_ggml(k) && x->scale_dtype != KVQ_DT_FP16 && (b = BLAME(&t->p[F + T_SCALE], pf)))
        sema_error(S, b->src, sema_prov_loc(b), "format %s stores its scale d in fp16 (ggml's block layout), not fp32",
                   fn);
    if (!kvq_format_has_zero(k) && t->p[F + T_ZERO].owner >= 0 && (b = BLAME(&t->p[F + T_ZERO], pf)))
        sema_error(S, b->src, sema_prov_loc(b),
                   "format %s stores no zero point (it is symmetric), so 'zero' does not apply to the %s", fn, name);
    if (!kvq_format_has_tensor_scale(k) && t->p[F + T_TSCALE].owner >= 0 && (b = BLAME(&t->p[F + T_TSCALE], pf)))
        sema_error(S, b->src, sema_prov_loc(b), "tensor_scale applies to formats e4m3, e5m2 and nvfp4, not %s", fn);
    if (k != KVQ_FMT_INT && x->group == KVQ_GROUP_HIDDEN && (b = BLAME(&t->p[F + T_GROUP], pf)))
        sema_error(S, b->src, sema_prov_loc(b), "group hidden needs format int, not %s", fn);
    if (k != KVQ_FMT_INT && x->channel_separable && (b = BLAME(&t->p[F + T_CS], pf)))
        sema_error(S, b->src, sema_prov_loc(b), "channel_separable needs format int, not %s", fn);
    if (k != KVQ_FMT_INT && t->c.quant.saliency.metric != KVQ_SAL_NONE && (b = BLAME(pf, &t->p[F_SAL_METRIC])))
        sema_error(S, b->src, sema_prov_loc(b),
                   "saliency needs format int (it gives each class of tokens its own bits), not %s", fn);
    if (k == KVQ_FMT_INT_SYM && x->bits < 2 && (b = BLAME(&t->p[F + T_BITS], pf)))
        sema_error(S, b->src, sema_prov_loc(b),
                   "format int symmetric needs at least 2 bits (1 bit has no grid symmetric about 0)");
    if (k == KVQ_FMT_CODEBOOK) {
        if (x->bits > 4 && (b = BLAME(&t->p[F + T_BITS], pf)))
            sema_error(S, b->src, sema_prov_loc(b), "a codebook has at most 16 levels: bits must be 1 to 4, not %d",
                       x->bits);
        else if (!x->format.codebook_normal && x->format.n_levels > (1 << x->bits) &&
                 (b = BLAME(&t->p[F + T_BITS], pf)))
            sema_error(S, b->src, sema_prov_loc(b), "codebook has %d levels, more than the %d that bits %d can address",
                       x->format.n_levels, 1 << x->bits, x->bits);
    }
}

void sema_finish_format(sema_lcfg *t)
{
    for (int key = 0; key < 2; key++) {
        kvq_tensor_cfg *x = key ? &t->c.quant.key : &t->c.quant.value;
        double lv[16];
        if (x->format.kind != KVQ_FMT_CODEBOOK || !x->format.codebook_normal || x->bits > 4) continue;
        if (kvq_lloyd_max_normal(x->bits, 1.0, lv, NULL) != 0) continue;
        x->format.n_levels = 1 << x->bits;
        for (int i = 0; i < x->format.n_levels; i++) x->format.levels[i] = (float)lv[i];
    }
}
