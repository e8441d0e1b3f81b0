/* Fuzz target: the engine's prefill and decode on every backend available, against the reference. The input
 * chooses a scheme (KIVI-, OTT-, ZipCache-like or fp16, with fuzzed bits, groups, windows and parameter dtypes),
 * dims (head_dim 64 or 128, MHA/GQA/MQA), the input dtype, a batch of 1-3 sequences with their own prefill
 * lengths, a number of decode steps, and the values: seeded random data at a chosen amplitude plus patches of
 * special values taken from the input (NaN, ±inf, ±65504, beyond fp16, -0, subnormals).
 *
 * Every backend runs the same calls. Invariants against the reference backend:
 *   - the same status for every call (the input policy refuses the same elements everywhere);
 *   - decode outputs finite and within 1e-3 of the reference (relative to the output's magnitude), widened by
 *     tanh(d/2) times each channel's value range for a bound d on fp32 logit error (logit_slack, compare);
 *   - read_cache bit-identical for every kv head (same codes, parameters and fp16 rows) and the memory
 *     statistics identical.
 * A backend that cannot run here (no compiler for the emulator, no GPU, no LLVM) is skipped. */
#include <math.h>
#include <string.h>

#include "fuzz.h"
#include "half.h"
#include "kvq.h"

const char fuzz_target_name[] = "engine";

/* Backends compared with the reference: a backend added to libkvq adds a line. */
static const kvq_backend_kind backends[] = {KVQ_BACKEND_REFERENCE, KVQ_BACKEND_EMU, KVQ_BACKEND_CPU};
#define N_BACKENDS ((int)(sizeof backends / sizeof backends[0]))

enum { MAX_BATCH = 3, MAX_PREFILL = 96, MAX_STEPS = 6, MAX_T = MAX_PREFILL + MAX_STEPS, MAX_D = 128, MAX_HKV = 2,
       MAX_H = 4, LAYERS = 2 };

typedef struct {
    const uint8_t *p;
    size_t n;
} reader;

static unsigned u8(reader *r)
{
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}

typedef struct {
    char spec[512];
    int D, HKV, H, batch, steps;
    int prefill[MAX_BATCH];
    kvq_dtype dtype;
} fuzz_case;

static const int bits_tab[] = {1, 2, 3, 4, 8, 16};

static void make_spec(reader *r, fuzz_case *c)
{
    int family = (int)(u8(r) % 4);
    int kb = bits_tab[u8(r) % 6];
    int vb = bits_tab[u8(r) % 6];
    int kg = 8 << (u8(r) % 3);                /* 8, 16, 32 */
    int rmul = (int)(u8(r) % 3);              /* residual = 0, 1, 2 key groups */
    unsigned v = u8(r);
    const char *vgroup = (v % 3) == 0 ? "32" : (v % 3) == 1 ? "64" : "all";
    const char *sd = u8(r) & 1 ? "fp32" : "fp16";
    const char *zd = u8(r) & 1 ? "fp32" : "fp16";
    unsigned sb = u8(r);
    int sinks = (int)(sb % 3) * 2;
    /* the same byte's next digit: a rotation (engine-level, docs/runtime.md "Rotations") for KIVI and OTT */
    static const char *const rot[3] = {"", " rotate hadamard seed 5;", " rotate random seed 9;"};
    const char *rotate = rot[sb / 3 % 3];
    switch (family) {
    case 0: /* KIVI */
        snprintf(c->spec, sizeof c->spec,
                 "scheme f { key { bits %d; per channel; group %d; scale %s; zero %s; }\n"
                 "  value { bits %d; per token; group %s; scale %s; zero %s; }\n  residual %d; sinks %d;%s }\n",
                 kb, kg, sd, zd, vb, vgroup, sd, zd, rmul * kg, sinks, rotate);
        break;
    case 1: { /* OTT: flush group with an outlier pool (reads sequenced: the corpus means the same everywhere) */
        int keep = 1 + (int)(u8(r) % 4);
        const char *by = u8(r) & 1 ? "smallest" : "largest";
        int spill = (int)(u8(r) % 3) * 4;
        snprintf(c->spec, sizeof c->spec,
                 "scheme f { key { bits %d; per channel; group %d; scale %s; }\n"
                 "  value { bits %d; per token; group %s; zero %s; }\n  residual %d; flush group;\n"
                 "  outliers { keep %d; by key_l1 %s; spill %d; }%s }\n",
                 kb == 16 ? 2 : kb, kg, sd, vb == 16 ? 2 : vb, vgroup, zd, rmul * kg, keep, by, spill, rotate);
        break;
    }
    case 2: { /* ZipCache: saliency with probes, channel-separable values */
        static const int his[] = {2, 3, 4, 8};
        int hi = his[u8(r) % 4];
        int lo = 1 + (int)(u8(r) % 2);
        const char *group = u8(r) & 1 ? "hidden" : vgroup;
        const char *metric = u8(r) & 1 ? "normalized" : "accumulated";
        int recent = 5 + (int)(u8(r) % 20);
        int random = (int)(u8(r) % 20);
        int salient = 10 + (int)(u8(r) % 80);
        int every = 4 + (int)(u8(r) % 12);
        snprintf(c->spec, sizeof c->spec,
                 "scheme f { key { per channel; group all; scale %s; }\n"
                 "  value { per token; channel_separable; group %s; }\n"
                 "  saliency %s { probes recent %d%% random %d%%; salient %d%% bits %d; rest bits %d; every %d; } }\n",
                 sd, group, metric, recent, random, salient, hi, lo, every);
        break;
    }
    default:
        snprintf(c->spec, sizeof c->spec, "scheme f { bits 16; sinks %d; }\n", sinks);
    }
}

static void make_case(reader *r, fuzz_case *c)
{
    make_spec(r, c);
    unsigned d = u8(r);
    c->D = d & 1 ? 128 : 64;
    c->HKV = 1 + (int)((d >> 1) & 1);
    c->H = c->HKV * (1 + (int)((d >> 2) & 1));
    if ((d >> 3) & 1) c->H = 4, c->HKV = 1; /* MQA */
    c->dtype = (kvq_dtype)((d >> 4) % 3);
    c->batch = 1 + (int)(u8(r) % MAX_BATCH);
    for (int i = 0; i < c->batch; i++) c->prefill[i] = 1 + (int)(u8(r) % MAX_PREFILL);
    c->steps = (int)(u8(r) % (MAX_STEPS + 1));
}

/* The values of a case, fp32 (converted to the engine dtype for each call). */
static float K[MAX_BATCH][LAYERS][MAX_HKV * MAX_T * MAX_D], V[MAX_BATCH][LAYERS][MAX_HKV * MAX_T * MAX_D],
    Q[MAX_BATCH][LAYERS][MAX_H * MAX_T * MAX_D];

static const float amps[] = {1.0f, 8.0f, 300.0f, 30000.0f};

static void make_values(reader *r, const fuzz_case *c)
{
    uint64_t seed_hi = u8(r), seed_lo = u8(r); /* sequenced: the corpus means the same to every compiler */
    uint64_t s = 0x9e3779b97f4a7c15ull ^ (seed_hi << 8 | seed_lo);
    float ak = amps[u8(r) % 4];
    float av = amps[u8(r) % 4];
    float aq = amps[u8(r) % 2];
    for (int b = 0; b < MAX_BATCH; b++)
        for (int l = 0; l < LAYERS; l++) {
            for (int i = 0; i < MAX_HKV * MAX_T * MAX_D; i++) {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                K[b][l][i] = ak * (float)((double)(s >> 11) / 4503599627370496.0 - 1.0);
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                V[b][l][i] = av * (float)((double)(s >> 11) / 4503599627370496.0 - 1.0);
            }
            for (int i = 0; i < MAX_H * MAX_T * MAX_D; i++) {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                Q[b][l][i] = aq * (float)((double)(s >> 11) / 4503599627370496.0 - 1.0);
            }
        }
    /* patches: (tensor, position, value) triples from the rest of the input */
    static const float special[] = {NAN, INFINITY, -INFINITY, 65504.0f, -65504.0f, 65520.0f, 1e5f, -0.0f,
                                    5.96e-8f, 0.0f, 1e-30f, 3e38f, 1.0f, -1.0f, 32768.0f, 2048.0f};
    while (r->n >= 4) {
        unsigned t = u8(r), hi = u8(r), lo = u8(r), v = u8(r);
        int b = (int)(t % (unsigned)c->batch), l = (int)((t >> 2) % LAYERS), which = (int)((t >> 3) % 3);
        size_t pos = (size_t)(hi << 8 | lo) * 7;
        float x = special[v % 16];
        if (which == 0)
            K[b][l][pos % (MAX_HKV * MAX_T * MAX_D)] = x;
        else if (which == 1)
            V[b][l][pos % (MAX_HKV * MAX_T * MAX_D)] = x;
        else
            Q[b][l][pos % (MAX_H * MAX_T * MAX_D)] = x;
    }
}

/* [heads][n] rows of tokens [t0, t0 + n) of a [heads][MAX_T][MAX_D]-strided buffer, converted to dtype. */
static void gather(const float *src, int heads, int D, int t0, int n, kvq_dtype dt, void *dst)
{
    static float tmp[MAX_H * MAX_T * MAX_D];
    for (int h = 0; h < heads; h++)
        for (int t = 0; t < n; t++)
            memcpy(tmp + ((size_t)h * n + t) * D, src + ((size_t)h * MAX_T + t0 + t) * MAX_D, (size_t)D * sizeof(float));
    size_t cnt = (size_t)heads * n * D;
    if (dt == KVQ_F32)
        memcpy(dst, tmp, cnt * sizeof(float));
    else if (dt == KVQ_F16)
        kvq_f16_from_f32_n(dst, tmp, cnt);
    else
        kvq_bf16_from_f32_n(dst, tmp, cnt);
}

/* x as the engine receives it in dtype dt. */
static float in_dtype(float x, kvq_dtype dt)
{
    return dt == KVQ_F32 ? x : dt == KVQ_F16 ? kvq_f16_round(x) : kvq_bf16_round(x);
}

/* What one backend produced. */
typedef struct {
    int skipped;
    kvq_status st[1 + LAYERS * (1 + MAX_STEPS)]; /* create, then each call in order */
    int n_st;
    float out[MAX_STEPS][LAYERS][MAX_BATCH][MAX_H * MAX_D];
    int dec_ok[MAX_STEPS][LAYERS]; /* the decode of step s, layer l succeeded */
    float kc[MAX_BATCH][LAYERS][MAX_HKV * MAX_T * MAX_D], vc[MAX_BATCH][LAYERS][MAX_HKV * MAX_T * MAX_D];
    int len[MAX_BATCH][LAYERS];
    kvq_mem_stats mem;
} run_result;

static run_result results[N_BACKENDS];

static void run_backend(const kvq_scheme *sch, const fuzz_case *c, kvq_backend_kind kind, run_result *res)
{
    memset(res, 0, sizeof *res);
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, c->H, c->HKV, c->D};
    cfg.backend = kind;
    cfg.dtype = c->dtype;
    cfg.seed = 7;
    kvq_engine *e = NULL;
    char err[512];
    kvq_status st = kvq_engine_create(sch, &cfg, &e, err, sizeof err);
    if (st == KVQ_ERR_UNAVAILABLE || (st == KVQ_ERR_UNSUPPORTED && kind != KVQ_BACKEND_REFERENCE)) {
        res->skipped = 1;
        return;
    }
    res->st[res->n_st++] = st;
    if (st != KVQ_OK) return;
    kvq_seq *seqs[MAX_BATCH] = {0};
    for (int b = 0; b < c->batch; b++) FUZZ_CHECK(kvq_seq_create(e, &seqs[b]) == KVQ_OK, "seq create");
    static unsigned char kb[MAX_BATCH][MAX_HKV * MAX_T * MAX_D * 4], vb[MAX_BATCH][MAX_HKV * MAX_T * MAX_D * 4],
        qb[MAX_BATCH][MAX_H * MAX_T * MAX_D * 4];
    int prefilled[LAYERS] = {0};
    for (int l = 0; l < LAYERS; l++) {
        kvq_prefill_item items[MAX_BATCH];
        for (int b = 0; b < c->batch; b++) {
            gather(K[b][l], c->HKV, c->D, 0, c->prefill[b], c->dtype, kb[b]);
            gather(V[b][l], c->HKV, c->D, 0, c->prefill[b], c->dtype, vb[b]);
            gather(Q[b][l], c->H, c->D, 0, c->prefill[b], c->dtype, qb[b]);
            items[b] = (kvq_prefill_item){seqs[b], c->prefill[b], kb[b], vb[b], qb[b]};
        }
        st = kvq_prefill(e, l, items, c->batch);
        res->st[res->n_st++] = st;
        prefilled[l] = st == KVQ_OK;
    }
    for (int s = 0; s < c->steps; s++)
        for (int l = 0; l < LAYERS; l++) {
            if (!prefilled[l]) continue;
            kvq_decode_item items[MAX_BATCH];
            for (int b = 0; b < c->batch; b++) {
                int t = c->prefill[b] + s;
                gather(K[b][l], c->HKV, c->D, t, 1, c->dtype, kb[b]);
                gather(V[b][l], c->HKV, c->D, t, 1, c->dtype, vb[b]);
                gather(Q[b][l], c->H, c->D, t, 1, c->dtype, qb[b]);
                items[b] = (kvq_decode_item){seqs[b], kb[b], vb[b], qb[b], res->out[s][l][b]};
            }
            st = kvq_decode(e, l, items, c->batch);
            res->st[res->n_st++] = st;
            res->dec_ok[s][l] = st == KVQ_OK;
        }
    for (int b = 0; b < c->batch; b++)
        for (int l = 0; l < LAYERS; l++) {
            int n = 0;
            if (prefilled[l]) {
                st = kvq_seq_read_cache(e, seqs[b], l, res->kc[b][l], res->vc[b][l], MAX_T, &n);
                FUZZ_CHECK(st == KVQ_OK, "read_cache: %s", kvq_engine_errmsg(e));
            }
            res->len[b][l] = n;
        }
    FUZZ_CHECK(kvq_engine_stats(e, &res->mem) == KVQ_OK, "stats");
    kvq_engine_free(e);
}

/* Bound d on the |logit| error of a backend that computes logits in fp32 (the reference computes them in double),
 * for query row q over tokens [0, n) of two [n][D] key sets, the original rows (in the engine's dtype) and the
 * final cache as read back: a token quantized after step s was an fp16 row then, so both count.
 *
 * A logit is scale * sum_i q_i k_i accumulated in fp32 (any order: sequential, tree, shuffles). The standard bound
 * for a sum of D rounded products is gamma_D * sum_i |q_i k_i|, gamma_D = D u / (1 - D u) with u = 2^-24 (Higham,
 * Accuracy and Stability, 3.1). The factor 4 covers what the kernels add to that: the query rounded once more
 * into the log2 domain (q * scale * log2 e), the folded key parameters of quantized pages (q s . codes + q . z,
 * whose terms may exceed |q k| when k is near the group's zero) and ex2.approx's relative error. The bound is for
 * the worst case: its rounding errors all of one sign; the typical error is about sqrt(D) smaller. */
static double logit_slack(const float *q, const float *k0, const float *k1, int n, int D, float scale)
{
    double worst = 0;
    for (int t = 0; t < n; t++) {
        double s0 = 0, s1 = 0;
        for (int i = 0; i < D; i++) {
            s0 += fabs((double)q[i] * k0[(size_t)t * D + i]);
            s1 += fabs((double)q[i] * k1[(size_t)t * D + i]);
        }
        worst = fmax(worst, fmax(s0, s1));
    }
    return worst * scale * (double)D * 6e-8 * 4;
}

static void compare(const fuzz_case *c, const run_result *ref, const run_result *be, kvq_backend_kind kind)
{
    const char *name = kvq_backend_name(kind);
    FUZZ_CHECK(be->n_st == ref->n_st, "%s made %d calls, the reference %d", name, be->n_st, ref->n_st);
    for (int i = 0; i < ref->n_st; i++)
        FUZZ_CHECK(be->st[i] == ref->st[i], "%s: call %d returned %s, the reference %s\nspec:\n%s", name, i,
                   kvq_status_str(be->st[i]), kvq_status_str(ref->st[i]), c->spec);
    if (ref->st[0] != KVQ_OK) return;
    float scale = 1.0f / sqrtf((float)c->D);
    for (int b = 0; b < c->batch; b++)
        for (int l = 0; l < LAYERS; l++) {
            FUZZ_CHECK(be->len[b][l] == ref->len[b][l], "%s: sequence %d layer %d holds %d tokens, the reference %d",
                       name, b, l, be->len[b][l], ref->len[b][l]);
            /* read_cache writes [kv_heads][capacity = MAX_T][head_dim]: each head's rows start at hk MAX_T D */
            size_t n = (size_t)ref->len[b][l] * (size_t)c->D;
            for (int hk = 0; hk < c->HKV; hk++) {
                size_t o = (size_t)hk * MAX_T * (size_t)c->D;
                FUZZ_CHECK(!memcmp(be->kc[b][l] + o, ref->kc[b][l] + o, n * sizeof(float)) &&
                               !memcmp(be->vc[b][l] + o, ref->vc[b][l] + o, n * sizeof(float)),
                           "%s: the cache of sequence %d layer %d kv head %d differs from the reference's\nspec:\n%s",
                           name, b, l, hk, c->spec);
            }
        }
    FUZZ_CHECK(!memcmp(&be->mem, &ref->mem, sizeof be->mem), "%s: memory statistics differ", name);
    for (int l = 0; l < LAYERS; l++)
        for (int s = 0, done = 0; s < c->steps; s++) {
            if (!ref->dec_ok[s][l]) continue;
            done++;
            for (int b = 0; b < c->batch; b++) {
                int len = c->prefill[b] + done; /* tokens attended at step s */
                for (int h = 0; h < c->H; h++) {
                    const float *o = ref->out[s][l][b] + (size_t)h * c->D, *x = be->out[s][l][b] + (size_t)h * c->D;
                    const int hk = h / (c->H / c->HKV);
                    const float *kv = ref->kc[b][l] + (size_t)hk * MAX_T * c->D; /* read_cache's layout */
                    const float *vv = ref->vc[b][l] + (size_t)hk * MAX_T * c->D;
                    const float *q = Q[b][l] + ((size_t)h * MAX_T + c->prefill[b] + s) * MAX_D;
                    /* the rows as given, in the engine's dtype, [len][D]: the prefill, then the tokens of the
                     * decode calls that were accepted up to step s (a refused call leaves the cache as it was) */
                    static float k0[MAX_T * MAX_D], v0[MAX_T * MAX_D], q0[MAX_D];
                    for (int t = 0, s1 = 0; t < len; t++) {
                        int src = t;
                        if (t >= c->prefill[b]) {
                            while (!ref->dec_ok[s1][l]) s1++;
                            src = c->prefill[b] + s1++;
                        }
                        for (int i = 0; i < c->D; i++) {
                            size_t at = ((size_t)hk * MAX_T + src) * MAX_D + i;
                            k0[(size_t)t * c->D + i] = in_dtype(K[b][l][at], c->dtype);
                            v0[(size_t)t * c->D + i] = in_dtype(V[b][l][at], c->dtype);
                        }
                    }
                    for (int i = 0; i < c->D; i++) q0[i] = in_dtype(q[i], c->dtype);
                    /* Logit errors |e_t| <= d move each weight by a factor p'_t / p_t in [e^-2d, e^2d] (the
                     * normaliser moves too). Over such pairs of distributions the total variation is at most
                     * tanh(d/2): with a the mass whose ratio is largest, R, and the rest at R e^-2d,
                     * TV = a (1 - a) (e^2d - 1) / (1 + a (e^2d - 1)), largest at a = 1 / (e^d + 1), where it is
                     * (e^d - 1) / (e^d + 1). Since the weights' changes sum to 0, a channel's output moves by
                     * sum_t (p'_t - p_t)(v_t - mid) <= 2 TV (range / 2) = tanh(d/2) range, range the channel's
                     * spread over the attended values (as given and as cached: both lie within it). */
                    double d = logit_slack(q0, k0, kv, len, c->D, scale);
                    double mag = 0, worst = 0, tol = 0, over = -INFINITY;
                    for (int i = 0; i < c->D; i++) {
                        FUZZ_CHECK(isfinite(o[i]) && isfinite(x[i]), "%s: non-finite output %g / %g", name,
                                   (double)x[i], (double)o[i]);
                        mag = fmax(mag, fabs(o[i]));
                    }
                    for (int i = 0; i < c->D; i++) {
                        double lo = INFINITY, hi = -INFINITY;
                        for (int t = 0; t < len; t++) {
                            lo = fmin(lo, fmin(vv[(size_t)t * c->D + i], v0[(size_t)t * c->D + i]));
                            hi = fmax(hi, fmax(vv[(size_t)t * c->D + i], v0[(size_t)t * c->D + i]));
                        }
                        double err = fabs((double)o[i] - x[i]), ti = 1e-3 * fmax(mag, 1.0) + tanh(d / 2) * (hi - lo);
                        if (err - ti > over) over = err - ti, worst = err, tol = ti; /* the channel nearest its limit */
                    }
                    FUZZ_CHECK(worst <= tol,
                               "%s: step %d layer %d sequence %d head %d differs from the reference by %g (tolerance %g)"
                               "\nspec:\n%s",
                               name, s, l, b, h, worst, tol, c->spec);
                }
            }
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader r = {data, size};
    fuzz_case c;
    memset(&c, 0, sizeof c);
    make_case(&r, &c);
    kvq_spec *spec = NULL;
    if (kvq_spec_parse_string("<fuzz>", c.spec, strlen(c.spec), &spec) != KVQ_OK) { /* e.g. residual % group */
        kvq_spec_free(spec);
        return 0;
    }
    make_values(&r, &c);
    const kvq_scheme *sch = kvq_spec_scheme(spec, NULL);
    for (int i = 0; i < N_BACKENDS; i++) run_backend(sch, &c, backends[i], &results[i]);
    FUZZ_CHECK(!results[0].skipped, "the reference backend is always available");
    for (int i = 1; i < N_BACKENDS; i++)
        if (!results[i].skipped) compare(&c, &results[0], &results[i], backends[i]);
    if (getenv("KVQ_FUZZ_VERBOSE")) { /* what an input did: to check that seeds reach what they are meant to */
        fprintf(stderr, "%sD %d HKV %d H %d dtype %d batch %d steps %d; statuses:", c.spec, c.D, c.HKV, c.H,
                (int)c.dtype, c.batch, c.steps);
        for (int i = 0; i < results[0].n_st; i++) fprintf(stderr, " %d", (int)results[0].st[i]);
        for (int i = 1; i < N_BACKENDS; i++)
            fprintf(stderr, "; %s %s", kvq_backend_name(backends[i]), results[i].skipped ? "skipped" : "compared");
        fputc('\n', stderr);
    }
    kvq_spec_free(spec);
    return 0;
}
