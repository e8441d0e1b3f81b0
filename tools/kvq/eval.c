/* kvq eval: run schemes over real or synthetic K/V/Q and measure what they lose. Prefill the first N tokens of
 * every layer, decode the rest one token at a time with their queries, and compare each decode step's attention
 * output with exact attention over the unquantized cache (the inputs rounded to fp16, which is what the cache
 * stores). docs/eval.md is the user's guide. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "exact_attn.h"
#include "half.h"
#include "kvq.h"
#include "kvq_tool.h"
#include "tool_spec.h"
#include "npy.h"
#include "scheme.h"
#include "synth.h"

#define MAX_SCHEMES 32
#define MAX_FILES 16
#define MAX_LAYERS 256

typedef struct {
    const char *files[MAX_FILES];
    int n_files;
    const char *schemes[MAX_SCHEMES];
    int n_schemes;
    const char *keys, *values, *queries, *out_dir;
    int synthetic, prefill; /* prefill -1: half the tokens */
    kvq_synth_params sp;
    int counts_given; /* --synth set heavy_hitters or outlier_tokens: never rescale them */
    kvq_backend_kind backend;
    int backend_given, threads; /* threads: the engine's and the exact baseline's (0: every core) */
    int per_layer;
    const char *plot; /* --plot FILE.png */
    int quiet;        /* no progress on stderr */
    /* which synthetic dims the command line gave (they win over a spec's model block) */
    int given_layers, given_heads, given_kv_heads, given_head_dim;
} eval_args;

/* The inputs, float32, [L][HKV][T][D] and [L][H][T][D]; K and V already rounded to fp16. */
typedef struct {
    int L, H, HKV, T, D;
    float *k, *v, *q;
    float *exact; /* exact attention of every decode step, [L][H][steps][D]: the same for every scheme */
    kvq_dtype dtype; /* what the values are representable in: the engine is fed this */
    kvq_npy nk, nv, nq;
    kvq_synth syn;
} eval_inputs;

typedef struct {
    const kvq_scheme *scheme;
    char file[PATH_MAX]; /* canonical path of the file that defines it (an included scheme is listed once) */
    double attn_layer_num[MAX_LAYERS], attn_layer_den[MAX_LAYERS];
    double attn_num, attn_den, key_num, key_den, val_num, val_den;
    kvq_mem_stats mem;
    int ok;
    char err[512];
} eval_result;

/* Generator parameters settable with --synth NAME=VALUE (the shapes and the seed have their own options). */
typedef struct {
    const char *name;
    int is_int;
    size_t off;
} synth_field;

#define SF_INT(f) {#f, 1, offsetof(kvq_synth_params, f)}
#define SF_DBL(f) {#f, 0, offsetof(kvq_synth_params, f)}
static const synth_field synth_fields[] = {
    SF_DBL(rope_base),      SF_DBL(key_smoothness),         SF_INT(outlier_channels),
    SF_DBL(outlier_channel_strength),                       SF_INT(outlier_tokens),
    SF_DBL(outlier_token_strength),                         SF_INT(outlier_token_first_layer),
    SF_DBL(query_shared),   SF_DBL(sink_strength),          SF_INT(heavy_hitters),
    SF_DBL(heavy_strength), SF_DBL(heavy_focus),            SF_DBL(query_focus),
    SF_DBL(query_local),    SF_DBL(query_noise),            SF_DBL(query_outlier),
    SF_DBL(value_token_spread),                             SF_INT(value_outlier_channels),
    SF_DBL(value_outlier_strength),
};
#undef SF_INT
#undef SF_DBL

static void usage(void)
{
    fprintf(stderr,
            "usage: kvq eval FILE... [--scheme NAME]... (--keys K.npy --values V.npy --queries Q.npy | --synthetic\n"
            "                [--layers L] [--heads H] [--kv-heads HKV] [--head-dim D] [--tokens T] [--seed S]\n"
            "                [--synth NAME=VALUE]...)\n"
            "                [--prefill N] [--backend reference|cpu|cuda|emu] [--threads N] [--per-layer] [--out-dir DIR]\n"
            "                [--plot FILE.png] [--quiet]\n"
            "  K, V: [layers, kv_heads, tokens, head_dim] (3-D: one layer); Q: [layers, heads, tokens, head_dim];\n"
            "  float32, float16 or bfloat16. Prefills N tokens (default: half), decodes the rest one at a time, and\n"
            "  reports the relative error of the attention outputs against exact attention, key/value reconstruction\n"
            "  errors, effective bits and memory for every scheme side by side. --synth sets a generator parameter\n"
            "  (docs/synthetic.md). --out-dir writes DIR/SCHEME/{attn,keys,values}.npy. Default backend: cpu when it\n"
            "  runs here, else reference (the oracle). --threads: the engine's and the exact attention's threads\n"
            "  (default: every core). --plot draws attention error against effective bits and per layer (python3\n"
            "  with matplotlib, or $KVQ_PYTHON). Synthetic dims not given come from the specs' model { } block.\n"
            "  Progress and notes go to stderr (--quiet: errors only). Guide: docs/eval.md.\n");
}

static int parse_synth(const char *s, eval_args *a)
{
    const char *eq = strchr(s, '=');
    if (!eq) return kvq_tool_error("eval", "--synth expects NAME=VALUE, got '%s'", s);
    size_t n = (size_t)(eq - s);
    for (size_t i = 0; i < sizeof synth_fields / sizeof synth_fields[0]; i++) {
        const synth_field *f = &synth_fields[i];
        if (strlen(f->name) != n || strncmp(f->name, s, n)) continue;
        char *field = (char *)&a->sp + f->off;
        if (f->is_int) {
            if (tool_int("kvq eval", f->name, eq + 1, INT_MIN, INT_MAX, (int *)(void *)field)) return -1;
            if (!strcmp(f->name, "heavy_hitters") || !strcmp(f->name, "outlier_tokens")) a->counts_given = 1;
        } else {
            char *end;
            errno = 0;
            double v = strtod(eq + 1, &end);
            if (errno || end == eq + 1 || *end || !isfinite(v))
                return kvq_tool_error("eval", "%s expects a number, got '%s'", f->name, eq + 1);
            *(double *)(void *)field = v;
        }
        return 0; /* ranges are the generator's to check: its message names the parameter */
    }
    return kvq_tool_error("eval", "--synth: unknown generator parameter '%.*s' (docs/synthetic.md lists them)",
                          (int)n, s);
}

static int parse_args(int argc, char **argv, eval_args *a)
{
    memset(a, 0, sizeof *a);
    a->sp = kvq_synth_params_default();
    a->prefill = -1;
    int synth_opts = 0;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "--synthetic")) {
            a->synthetic = 1;
            continue;
        }
        if (!strcmp(o, "--per-layer")) {
            a->per_layer = 1;
            continue;
        }
        if (!strcmp(o, "--quiet")) {
            a->quiet = 1;
            continue;
        }
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) return 1;
        if (o[0] != '-') {
            if (a->n_files == MAX_FILES) return kvq_tool_error("eval", "at most %d spec files", MAX_FILES);
            a->files[a->n_files++] = o;
            continue;
        }
        if (!v) return kvq_tool_error("eval", "%s needs a value", o);
        i++;
        int bad = 0, synth_opt = 1;
        if (!strcmp(o, "--layers"))
            bad = tool_int("kvq eval", o, v, 1, MAX_LAYERS, &a->sp.layers), a->given_layers = 1;
        else if (!strcmp(o, "--heads"))
            bad = tool_int("kvq eval", o, v, 1, 256, &a->sp.heads), a->given_heads = 1;
        else if (!strcmp(o, "--kv-heads"))
            bad = tool_int("kvq eval", o, v, 1, 256, &a->sp.kv_heads), a->given_kv_heads = 1;
        else if (!strcmp(o, "--head-dim"))
            bad = tool_int("kvq eval", o, v, 16, 256, &a->sp.head_dim), a->given_head_dim = 1;
        else if (!strcmp(o, "--tokens"))
            bad = tool_int("kvq eval", o, v, 2, 1 << 20, &a->sp.tokens);
        else if (!strcmp(o, "--synth"))
            bad = parse_synth(v, a);
        else
            synth_opt = 0;
        synth_opts += synth_opt;
        if (synth_opt) {
            if (bad) return -1;
            continue;
        }
        if (!strcmp(o, "--scheme")) {
            if (a->n_schemes == MAX_SCHEMES) return kvq_tool_error("eval", "at most %d schemes", MAX_SCHEMES);
            a->schemes[a->n_schemes++] = v;
        } else if (!strcmp(o, "--keys"))
            a->keys = v;
        else if (!strcmp(o, "--values"))
            a->values = v;
        else if (!strcmp(o, "--queries"))
            a->queries = v;
        else if (!strcmp(o, "--out-dir"))
            a->out_dir = v;
        else if (!strcmp(o, "--plot"))
            a->plot = v;
        else if (!strcmp(o, "--prefill"))
            bad = tool_int("kvq eval", o, v, 1, 1 << 24, &a->prefill);
        else if (!strcmp(o, "--seed")) {
            /* The seed also seeds the engine (ZipCache's random probes), so it applies to .npy inputs too. */
            int seed = 0;
            bad = tool_int("kvq eval", o, v, 0, 0x7fffffff, &seed);
            a->sp.seed = (uint64_t)seed;
        } else if (!strcmp(o, "--backend")) {
            bad = kvq_tool_backend("eval", v, &a->backend);
            a->backend_given = 1;
        } else if (!strcmp(o, "--threads"))
            bad = tool_int("kvq eval", o, v, 0, 1024, &a->threads);
        else
            return kvq_tool_error("eval", "unknown option '%s'", o);
        if (bad) return -1;
    }
    if (!a->n_files) return kvq_tool_error("eval", "no spec file given");
    int any_npy = a->keys || a->values || a->queries;
    if (a->synthetic && any_npy)
        return kvq_tool_error("eval", "--synthetic and --keys/--values/--queries exclude each other");
    if (!a->synthetic && !(a->keys && a->values && a->queries))
        return kvq_tool_error("eval", "give --synthetic, or all of --keys, --values and --queries");
    if (!a->synthetic && synth_opts)
        return kvq_tool_error("eval",
                              "--layers, --heads, --kv-heads, --head-dim, --tokens and --synth need --synthetic");
    return 0;
}

/* A short synthetic sequence cannot hold the default numbers of heavy hitters and outlier tokens (they take
 * distinct tokens after the sink). Unless the user set them, scale both down in proportion to what fits, and
 * say so: the generator's own message would name parameters the user never wrote. */
static void fit_feature_counts(eval_args *a)
{
    kvq_synth_params *p = &a->sp;
    int room = p->tokens - 1, want = p->heavy_hitters + p->outlier_tokens;
    if (a->counts_given || want <= room || want <= 0) return;
    int hh = (int)((long long)p->heavy_hitters * room / want), ot = room - hh;
    if (ot > p->outlier_tokens) { /* rounding gave the outlier tokens more than they asked for */
        ot = p->outlier_tokens;
        hh = room - ot;
    }
    fprintf(stderr,
            "kvq eval: %d synthetic tokens hold %d heavy hitter%s and %d outlier token%s (defaults %d and %d)\n",
            p->tokens, hh, hh == 1 ? "" : "s", ot, ot == 1 ? "" : "s", p->heavy_hitters, p->outlier_tokens);
    p->heavy_hitters = hh;
    p->outlier_tokens = ot;
}

/* A 3-D file is one layer: [kv_heads, tokens, head_dim]. */
static int npy_dims(const kvq_npy *a, const char *path, int *L, int *Hx, int *T, int *D)
{
    if (a->ndim != 3 && a->ndim != 4)
        return kvq_tool_error("eval", "%s: expected 3 or 4 dimensions ([layers,] heads, tokens, head_dim), found %d",
                              path, a->ndim);
    const size_t *s = a->shape + (a->ndim - 3);
    size_t l = a->ndim == 4 ? a->shape[0] : 1;
    if (!l || !s[0] || !s[1] || !s[2]) return kvq_tool_error("eval", "%s: a dimension is 0", path);
    if (l > MAX_LAYERS) return kvq_tool_error("eval", "%s: %zu layers, at most %d", path, l, MAX_LAYERS);
    if (s[0] > 4096 || s[1] > (size_t)INT_MAX || s[2] > 4096)
        return kvq_tool_error("eval", "%s: dimensions %zu x %zu x %zu are out of range", path, s[0], s[1], s[2]);
    *L = (int)l, *Hx = (int)s[0], *T = (int)s[1], *D = (int)s[2];
    return 0;
}

/* An input must be a regular file: opened non-blocking, so a FIFO without a writer is refused at once instead of
 * blocking the open forever. */
static int check_input_file(const char *path)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return kvq_tool_error("eval", "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    int bad = fstat(fd, &st) != 0 || !S_ISREG(st.st_mode);
    close(fd);
    if (bad)
        return kvq_tool_error("eval", "%s: not a regular file (a FIFO, a device or a directory); kvq eval reads .npy files",
                              path);
    return 0;
}

static int load_inputs(const eval_args *a, eval_inputs *in)
{
    char err[600];
    memset(in, 0, sizeof *in);
    if (a->synthetic) {
        if (kvq_synth_generate(&a->sp, &in->syn, err, sizeof err) != KVQ_OK) return kvq_tool_error("eval", "%s", err);
        in->L = a->sp.layers, in->H = a->sp.heads, in->HKV = a->sp.kv_heads, in->T = a->sp.tokens;
        in->D = a->sp.head_dim;
        in->k = in->syn.k, in->v = in->syn.v, in->q = in->syn.q;
        in->dtype = KVQ_F16;
        /* Real caches come from fp16 models: round the queries too, so the engine can be fed fp16. */
        for (size_t i = 0; i < in->syn.q_count; i++) in->q[i] = kvq_f16_round(in->q[i]);
    } else {
        const char *paths[3] = {a->keys, a->values, a->queries};
        kvq_npy *arrs[3] = {&in->nk, &in->nv, &in->nq};
        /* Headers first: the shapes are compared before any data is read. */
        for (int i = 0; i < 3; i++) {
            if (check_input_file(paths[i])) return -1;
            if (kvq_npy_read_header(paths[i], arrs[i], err, sizeof err) != KVQ_OK)
                return kvq_tool_error("eval", "%s", err);
        }
        int L, HKV, T, D, L2, HKV2, T2, D2, L3, H, T3, D3;
        if (npy_dims(&in->nk, a->keys, &L, &HKV, &T, &D) || npy_dims(&in->nv, a->values, &L2, &HKV2, &T2, &D2) ||
            npy_dims(&in->nq, a->queries, &L3, &H, &T3, &D3))
            return -1;
        if (L != L2 || HKV != HKV2 || T != T2 || D != D2)
            return kvq_tool_error("eval", "%s [%d, %d, %d, %d] and %s [%d, %d, %d, %d] differ in shape", a->keys, L,
                                  HKV, T, D, a->values, L2, HKV2, T2, D2);
        if (L3 != L || T3 != T || D3 != D)
            return kvq_tool_error("eval", "%s: expected [%d, heads, %d, %d] to match the keys, got [%d, %d, %d, %d]",
                                  a->queries, L, T, D, L3, H, T3, D3);
        if (H % HKV)
            return kvq_tool_error("eval", "%s: %d query heads is not a multiple of the %d kv heads of %s", a->queries,
                                  H, HKV, a->keys);
        if (T < 2)
            return kvq_tool_error("eval", "%s: 1 token; at least 2 are needed (a prefill and a decode step)",
                                  a->keys);
        for (int i = 0; i < 3; i++) {
            kvq_npy h = *arrs[i];
            if (kvq_npy_read(paths[i], arrs[i], err, sizeof err) != KVQ_OK) return kvq_tool_error("eval", "%s", err);
            if (arrs[i]->ndim != h.ndim || memcmp(arrs[i]->shape, h.shape, sizeof h.shape) || arrs[i]->dtype != h.dtype)
                return kvq_tool_error("eval", "%s changed while it was read", paths[i]);
        }
        in->L = L, in->H = H, in->HKV = HKV, in->T = T, in->D = D;
        in->k = in->nk.data, in->v = in->nv.data, in->q = in->nq.data;
        /* Feed the engine the files' type when they agree, else float32, so nothing is rounded on the way in. */
        kvq_dtype dk = in->nk.dtype, dv = in->nv.dtype, dq = in->nq.dtype;
        in->dtype = (dk == dv && dv == dq) ? dk : KVQ_F32;
    }
    /* The cache stores fp16 (docs/runtime.md), so the reference is exact attention over fp16 K and V, and the
     * reconstruction errors are measured against them. Rounding here changes nothing the engine sees (it rounds
     * on arrival, and an fp16-rounded fp32 or bf16 value is still representable in its type). */
    size_t kvn = (size_t)in->L * in->HKV * in->T * in->D;
    /* A value fp16 cannot hold is left as given: the engine refuses it and names it (docs/runtime.md). */
    for (size_t i = 0; i < kvn; i++) {
        if (fabsf(in->k[i]) <= 65504.0f) in->k[i] = kvq_f16_round(in->k[i]);
        if (fabsf(in->v[i]) <= 65504.0f) in->v[i] = kvq_f16_round(in->v[i]);
    }
    return 0;
}

static void free_inputs(eval_inputs *in)
{
    kvq_npy_free(&in->nk);
    kvq_npy_free(&in->nv);
    kvq_npy_free(&in->nq);
    kvq_synth_free(&in->syn);
    free(in->exact);
}

/* Converts n floats to the engine dtype into dst. */
static void to_dtype(kvq_dtype dt, const float *src, size_t n, void *dst)
{
    if (dt == KVQ_F32)
        memcpy(dst, src, n * sizeof(float));
    else if (dt == KVQ_F16)
        kvq_f16_from_f32_n(dst, src, n);
    else
        kvq_bf16_from_f32_n(dst, src, n);
}

/* Gathers rows [t0, t0 + n) of every head of layer l of a [L][Hx][T][D] tensor into [Hx][n][D]. */
static void gather(const float *x, const eval_inputs *in, int Hx, int l, int t0, int n, float *dst)
{
    for (int h = 0; h < Hx; h++)
        memcpy(dst + (size_t)h * n * in->D, x + (((size_t)l * Hx + h) * in->T + t0) * in->D,
               (size_t)n * in->D * sizeof(float));
}

static int write_outputs(const char *dir, const eval_result *r, const eval_inputs *in, const float *attn, int steps,
                         const float *kc, const float *vc)
{
    char path[4096], err[600];
    if (mkdir(dir, 0777) && errno != EEXIST) return kvq_tool_error("eval", "%s: %s", dir, strerror(errno));
    snprintf(path, sizeof path, "%s/%s", dir, kvq_scheme_name(r->scheme));
    if (mkdir(path, 0777) && errno != EEXIST) return kvq_tool_error("eval", "%s: %s", path, strerror(errno));
    size_t sa[4] = {(size_t)in->L, (size_t)in->H, (size_t)steps, (size_t)in->D};
    size_t sk[4] = {(size_t)in->L, (size_t)in->HKV, (size_t)in->T, (size_t)in->D};
    struct {
        const char *name;
        const float *data;
        const size_t *shape;
    } files[3] = {{"attn.npy", attn, sa}, {"keys.npy", kc, sk}, {"values.npy", vc, sk}};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s/%s", dir, kvq_scheme_name(r->scheme), files[i].name);
        if (kvq_npy_write(path, KVQ_F32, files[i].shape, 4, files[i].data, err, sizeof err) != KVQ_OK)
            return kvq_tool_error("eval", "%s", err);
    }
    return 0;
}

static int prefill_len(const eval_args *a, const eval_inputs *in) { return a->prefill > 0 ? a->prefill : in->T / 2; }

/* Exact attention of every (layer, query head, decode step) into in->exact, once for all schemes, threaded:
 * bit-identical to one thread (runtime/exact_attn.h). Returns 0, or -1 when out of memory. */
static int compute_exact(const eval_args *a, eval_inputs *in)
{
    int L = in->L, H = in->H, HKV = in->HKV, T = in->T, D = in->D, N = prefill_len(a, in), steps = T - N;
    size_t n = (size_t)L * H * steps;
    kvq_exact_job *jobs = malloc(n * sizeof *jobs);
    in->exact = malloc(n * D * sizeof(float));
    if (!jobs || !in->exact) {
        free(jobs);
        return kvq_tool_error("eval", "out of memory for the exact attention of %zu decode rows", n);
    }
    for (int l = 0; l < L; l++)
        for (int h = 0; h < H; h++)
            for (int s = 0; s < steps; s++) {
                /* Query head h reads kv head h / (H / HKV) (MHA, GQA, MQA); step s attends over N + s + 1 tokens. */
                size_t kv = ((size_t)l * HKV + h / (H / HKV)) * T * D, j = ((size_t)l * H + h) * steps + s;
                jobs[j] = (kvq_exact_job){in->q + (((size_t)l * H + h) * T + N + s) * D, in->k + kv, in->v + kv,
                                          N + s + 1, in->exact + j * D};
            }
    kvq_exact_attention_many(jobs, n, D, D, 1.0f / sqrtf((float)D), a->threads);
    free(jobs);
    return 0;
}

/* Progress on stderr: a line rewritten in place on a terminal, else one line every 10 s (logs stay short). */
typedef struct {
    const char *name;
    int quiet, tty, shown;
    double start, last;
} progress;

static void progress_show(progress *p, const char *phase, int layer, int step, int steps)
{
    double t = kvq_tool_now();
    if (p->quiet || t - p->last < (p->tty ? 0.25 : 10.0)) return;
    p->last = t;
    p->shown = 1;
    char eta[48] = "";
    if (step > 0) snprintf(eta, sizeof eta, ", about %.0f s left", (t - p->start) / step * (steps - step));
    fprintf(stderr, "%skvq eval: %s: %s, layer %d, decode step %d/%d, %.0f s%s%s", p->tty ? "\r\033[K" : "",
            p->name, phase, layer, step, steps, t - p->start, eta, p->tty ? "" : "\n");
}

static void progress_done(progress *p)
{
    if (p->tty && p->shown) fprintf(stderr, "\r\033[K");
}

/* Runs one scheme end to end. Errors go into r->err; returns 0 on success. */
static int run_scheme(const eval_args *a, const eval_inputs *in, eval_result *r)
{
    int L = in->L, H = in->H, HKV = in->HKV, T = in->T, D = in->D;
    int N = prefill_len(a, in), steps = T - N;
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){L, H, HKV, D};
    cfg.backend = a->backend;
    cfg.dtype = in->dtype;
    cfg.seed = a->sp.seed;
    cfg.threads = a->threads;
    kvq_engine *eng = NULL;
    kvq_seq *seq = NULL;
    int rc = -1;
    double t0 = kvq_tool_now();
    progress pr = {kvq_scheme_name(r->scheme), a->quiet, isatty(2), 0, t0, t0};
    size_t esz = in->dtype == KVQ_F32 ? 4 : 2;
    size_t kvn = (size_t)HKV * T * D, qn = (size_t)H * T * D;
    float *fk = malloc(kvn * sizeof(float)), *fv = malloc(kvn * sizeof(float)), *fq = malloc(qn * sizeof(float));
    void *bk = malloc(kvn * esz), *bv = malloc(kvn * esz), *bq = malloc(qn * esz);
    float *attn = malloc((size_t)L * H * steps * D * sizeof(float));
    float *kc = malloc((size_t)L * kvn * sizeof(float)), *vc = malloc((size_t)L * kvn * sizeof(float));
    float *tmp = malloc((size_t)H * D * sizeof(float));
    if (!fk || !fv || !fq || !bk || !bv || !bq || !attn || !kc || !vc || !tmp) {
        snprintf(r->err, sizeof r->err, "out of memory");
        goto done;
    }
    kvq_status cst = kvq_engine_create(r->scheme, &cfg, &eng, r->err, sizeof r->err);
    if (cst == KVQ_ERR_UNSUPPORTED && !a->backend_given && cfg.backend != KVQ_BACKEND_REFERENCE) {
        /* The default backend cannot run this scheme: the oracle can, and the user did not ask for a backend. */
        fprintf(stderr, "kvq eval: note: %s: %s; running it on the reference backend\n", kvq_scheme_name(r->scheme),
                r->err);
        cfg.backend = KVQ_BACKEND_REFERENCE;
        cst = kvq_engine_create(r->scheme, &cfg, &eng, r->err, sizeof r->err);
    }
    if (cst != KVQ_OK) goto done;
    if (kvq_seq_create(eng, &seq) != KVQ_OK) goto engine_error;

    for (int l = 0; l < L; l++) {
        progress_show(&pr, "prefill", l, 0, steps);
        gather(in->k, in, HKV, l, 0, N, fk);
        gather(in->v, in, HKV, l, 0, N, fv);
        gather(in->q, in, H, l, 0, N, fq);
        to_dtype(in->dtype, fk, (size_t)HKV * N * D, bk);
        to_dtype(in->dtype, fv, (size_t)HKV * N * D, bv);
        to_dtype(in->dtype, fq, (size_t)H * N * D, bq);
        kvq_prefill_item it = {seq, N, bk, bv, bq};
        if (kvq_prefill(eng, l, &it, 1) != KVQ_OK) goto engine_error;
    }
    for (int s = 0; s < steps; s++) {
        int t = N + s;
        for (int l = 0; l < L; l++) {
            progress_show(&pr, "decode", l, s, steps);
            gather(in->k, in, HKV, l, t, 1, fk);
            gather(in->v, in, HKV, l, t, 1, fv);
            gather(in->q, in, H, l, t, 1, fq);
            to_dtype(in->dtype, fk, (size_t)HKV * D, bk);
            to_dtype(in->dtype, fv, (size_t)HKV * D, bv);
            to_dtype(in->dtype, fq, (size_t)H * D, bq);
            kvq_decode_item it = {seq, bk, bv, bq, tmp};
            if (kvq_decode(eng, l, &it, 1) != KVQ_OK) goto engine_error;
            for (int h = 0; h < H; h++) {
                const float *ref = in->exact + (((size_t)l * H + h) * steps + s) * D;
                /* attn.npy is [L][H][steps][D]. */
                memcpy(attn + (((size_t)l * H + h) * steps + s) * D, tmp + (size_t)h * D, (size_t)D * sizeof(float));
                double num = 0, den = 0;
                for (int c = 0; c < D; c++) {
                    double e = (double)tmp[h * D + c] - ref[c];
                    num += e * e;
                    den += (double)ref[c] * ref[c];
                }
                r->attn_layer_num[l] += num;
                r->attn_layer_den[l] += den;
                r->attn_num += num;
                r->attn_den += den;
            }
        }
    }
    for (int l = 0; l < L; l++) {
        int n = 0;
        float *lk = kc + (size_t)l * kvn, *lv = vc + (size_t)l * kvn;
        if (kvq_seq_read_cache(eng, seq, l, lk, lv, T, &n) != KVQ_OK) goto engine_error;
        if (n != T) {
            snprintf(r->err, sizeof r->err, "layer %d holds %d tokens, expected %d", l, n, T);
            goto done;
        }
        const float *ok = in->k + (size_t)l * kvn, *ov = in->v + (size_t)l * kvn;
        for (size_t i = 0; i < kvn; i++) {
            double ek = (double)lk[i] - ok[i], ev = (double)lv[i] - ov[i];
            r->key_num += ek * ek;
            r->key_den += (double)ok[i] * ok[i];
            r->val_num += ev * ev;
            r->val_den += (double)ov[i] * ov[i];
        }
    }
    if (kvq_engine_stats(eng, &r->mem) != KVQ_OK) goto engine_error;
    if (a->out_dir && write_outputs(a->out_dir, r, in, attn, steps, kc, vc)) {
        snprintf(r->err, sizeof r->err, "could not write its outputs under %s", a->out_dir);
        goto done;
    }
    r->ok = 1;
    rc = 0;
    goto done;
engine_error:
    snprintf(r->err, sizeof r->err, "%s", kvq_engine_errmsg(eng));
done:
    progress_done(&pr);
    if (seq) kvq_seq_free(eng, seq);
    kvq_engine_free(eng);
    free(fk), free(fv), free(fq), free(bk), free(bv), free(bq), free(attn), free(kc), free(vc), free(tmp);
    return rc;
}

/* Relative error sqrt(num / den). Not measured (issue 12): NaN when either sum is NaN or infinite, and undefined
 * when the reference is zero (den == 0); the table then says so instead of printing a perfect 0. */
typedef enum { REL_OK, REL_NAN, REL_UNDEFINED } rel_kind;
static rel_kind rel_of(double num, double den, double *out)
{
    *out = NAN;
    if (!isfinite(num) || !isfinite(den) || num < 0 || den < 0) return REL_NAN;
    if (den == 0) return REL_UNDEFINED;
    *out = sqrt(num / den);
    return REL_OK;
}

/* One cell of an error row; counts the cells that were not measured. Below 1e-3, %.6f would show two digits or
 * none (3.4e-7, the cpu backend's fp32 arithmetic on specs/fp16.kvq, printed 0.000000, a perfect score): %.3g
 * keeps three significant digits there (0.000123, 3.4e-07), so only an exact 0 prints as 0.000000. */
static void print_rel(int w, double num, double den, int *unmeasured)
{
    double v;
    rel_kind k = rel_of(num, den, &v);
    if (k == REL_OK && v != 0 && v < 1e-3)
        printf(" %*.3g", w, v);
    else if (k == REL_OK)
        printf(" %*.6f", w, v);
    else
        printf(" %*s", w, k == REL_NAN ? "nan" : "undefined");
    *unmeasured += k != REL_OK;
}

/* Prints the table; returns the number of error cells that were not measured (NaN or undefined). */
static int print_table(const eval_args *a, const eval_inputs *in, eval_result *res, int n)
{
    int unmeasured = 0;
    int N = prefill_len(a, in), w = 14;
    for (int i = 0; i < n; i++) {
        int len = (int)strlen(kvq_scheme_name(res[i].scheme));
        if (len > w) w = len;
    }
    printf("kvq eval: %d layer%s, %d heads, %d kv heads, head_dim %d, %d tokens (prefill %d, decode %d), ", in->L,
           in->L == 1 ? "" : "s", in->H, in->HKV, in->D, in->T, N, in->T - N);
    if (a->synthetic)
        printf("synthetic, seed %llu\n", (unsigned long long)a->sp.seed);
    else
        printf("%s\n", kvq_npy_dtype_name(in->dtype));
    printf("%-22s", "");
    for (int i = 0; i < n; i++) printf(" %*s", w, kvq_scheme_name(res[i].scheme));
    printf("\n");
#define ROW(title, expr)                                                                                       \
    do {                                                                                                       \
        printf("%-22s", title);                                                                                \
        for (int i = 0; i < n; i++) {                                                                          \
            if (res[i].ok)                                                                                     \
                printf(" %*.6f", w, (double)(expr));                                                           \
            else                                                                                               \
                printf(" %*s", w, "error");                                                                    \
        }                                                                                                      \
        printf("\n");                                                                                          \
    } while (0)
#define REL_ROW(title, num, den)                                                                               \
    do {                                                                                                       \
        printf("%-22s", title);                                                                                \
        for (int i = 0; i < n; i++) {                                                                          \
            if (res[i].ok)                                                                                     \
                print_rel(w, (num), (den), &unmeasured);                                                       \
            else                                                                                               \
                printf(" %*s", w, "error");                                                                    \
        }                                                                                                      \
        printf("\n");                                                                                          \
    } while (0)
    REL_ROW("attn rel err", res[i].attn_num, res[i].attn_den);
    if (a->per_layer)
        for (int l = 0; l < in->L; l++) {
            char t[32];
            snprintf(t, sizeof t, "  layer %d", l);
            REL_ROW(t, res[i].attn_layer_num[l], res[i].attn_layer_den[l]);
        }
    REL_ROW("key rel err", res[i].key_num, res[i].key_den);
    REL_ROW("value rel err", res[i].val_num, res[i].val_den);
#undef REL_ROW
    ROW("effective bits", res[i].mem.effective_bits);
    ROW("compression ratio", res[i].mem.compression_ratio);
    ROW("device KiB", (double)res[i].mem.device_bytes / 1024.0);
#undef ROW
    for (int i = 0; i < n; i++)
        if (!res[i].ok) fprintf(stderr, "kvq eval: %s: %s\n", kvq_scheme_name(res[i].scheme), res[i].err);
    /* On a short sequence the fp16 windows (sinks, residual) take most of the cache, and the effective bits say
     * more about the window sizes than about the quantizer. */
    fflush(stdout);
    char names[512] = "";
    size_t used = 0;
    for (int i = 0; i < n; i++) {
        const kvq_mem_stats *m = &res[i].mem;
        double win = (double)m->bytes[KVQ_SEG_SINK] + (double)m->bytes[KVQ_SEG_RESIDUAL];
        if (res[i].ok && m->effective_bits < 15.5 && m->device_bytes > 0 && win / (double)m->device_bytes > 0.25 &&
            used < sizeof names)
            used += (size_t)snprintf(names + used, sizeof names - used, "%s%s %.0f%%", used ? ", " : "",
                                     kvq_scheme_name(res[i].scheme), 100.0 * win / (double)m->device_bytes);
    }
    if (used && !a->quiet)
        fprintf(stderr,
                "kvq eval: note: at %d tokens the fp16 windows (sinks, residual) take much of the cache (%s of the "
                "bytes), so the effective bits mostly reflect the windows; measure at a length where they are a small "
                "part (docs/eval.md uses --tokens 4096 --prefill 3584)\n",
                in->T, names);
    if (unmeasured)
        fprintf(stderr,
                "kvq eval: %d error figure%s could not be measured: 'nan' (a NaN or infinite sum) or 'undefined' "
                "(the reference is zero, so a relative error has no meaning)\n",
                unmeasured, unmeasured == 1 ? "" : "s");
    return unmeasured;
}


/* A spec's model { } block gives the dims the scheme is meant for (kvqc report honours it too). Synthetic inputs
 * take every dim the command line leaves out from it; .npy inputs must agree with it. */
static int model_dims_for_synth(eval_args *a, const eval_result *res, int n)
{
    struct {
        const char *what;
        int given, *dst;
        size_t off;
    } dims[4] = {{"layers", a->given_layers, &a->sp.layers, offsetof(kvq_model_dims, layers)},
                 {"heads", a->given_heads, &a->sp.heads, offsetof(kvq_model_dims, heads)},
                 {"kv_heads", a->given_kv_heads, &a->sp.kv_heads, offsetof(kvq_model_dims, kv_heads)},
                 {"head_dim", a->given_head_dim, &a->sp.head_dim, offsetof(kvq_model_dims, head_dim)}};
    int from[4] = {-1, -1, -1, -1};
    for (int d = 0; d < 4; d++) {
        if (dims[d].given) continue;
        for (int i = 0; i < n; i++) {
            int v = *(const int *)(const void *)((const char *)&res[i].scheme->model + dims[d].off);
            if (v <= 0) continue;
            if (from[d] >= 0 && *dims[d].dst != v)
                return kvq_tool_error("eval", "schemes '%s' and '%s' are for models with %s %d and %d: evaluate them "
                                      "separately, or give --%s", kvq_scheme_name(res[from[d]].scheme),
                                      kvq_scheme_name(res[i].scheme), dims[d].what, *dims[d].dst, v,
                                      d == 2 ? "kv-heads" : d == 3 ? "head-dim" : dims[d].what);
            *dims[d].dst = v;
            from[d] = i;
        }
    }
    /* A model block with heads but no kv_heads is multi-head attention, as in kvqc report. */
    if (!a->given_kv_heads && from[2] < 0 && from[1] >= 0) a->sp.kv_heads = a->sp.heads;
    if (!a->quiet && (from[0] >= 0 || from[1] >= 0 || from[2] >= 0 || from[3] >= 0))
        fprintf(stderr, "kvq eval: synthetic dims from the model block of the spec: %d layers, %d heads, %d kv heads, "
                        "head_dim %d\n", a->sp.layers, a->sp.heads, a->sp.kv_heads, a->sp.head_dim);
    return 0;
}

static int model_dims_match_inputs(const eval_result *res, int n, const eval_inputs *in)
{
    for (int i = 0; i < n; i++) {
        const kvq_model_dims *m = &res[i].scheme->model;
        int have[4] = {in->L, in->H, in->HKV, in->D}, want[4] = {m->layers, m->heads, m->kv_heads, m->head_dim};
        const char *what[4] = {"layers", "heads", "kv heads", "head_dim"};
        for (int d = 0; d < 4; d++)
            if (want[d] > 0 && want[d] != have[d])
                return kvq_tool_error("eval", "scheme '%s' (%s:%d) is for a model with %s %d; the inputs have %d",
                                      kvq_scheme_name(res[i].scheme), res[i].scheme->file, res[i].scheme->line,
                                      what[d], want[d], have[d]);
    }
    return 0;
}

/* --plot: the results as JSON beside the picture, drawn by python/kvq/plot.py (matplotlib). */
/* A relative error as JSON: null when it was not measured (rel_of), never a made-up number. */
static void json_rel(FILE *f, double num, double den)
{
    double v;
    if (rel_of(num, den, &v) == REL_OK)
        fprintf(f, "%.9g", v);
    else
        fprintf(f, "null");
}

static int plot_results(const eval_args *a, const eval_inputs *in, const eval_result *res, int n)
{
    char json[4200], script[4200];
    snprintf(json, sizeof json, "%.4090s.json", a->plot);
    FILE *f = fopen(json, "w");
    if (!f) return kvq_tool_error("eval", "%s: %s", json, strerror(errno));
    fprintf(f, "{\"layers\": %d, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"tokens\": %d, \"prefill\": %d, "
               "\"synthetic\": %s,\n \"schemes\": [", in->L, in->H, in->HKV, in->D, in->T, prefill_len(a, in),
            a->synthetic ? "true" : "false");
    int first = 1;
    for (int i = 0; i < n; i++) {
        if (!res[i].ok) continue;
        fprintf(f, "%s\n  {\"name\": ", first ? "" : ",");
        first = 0;
        kvq_tool_json_string(f, kvq_scheme_name(res[i].scheme));
        fprintf(f, ", \"file\": ");
        kvq_tool_json_string(f, res[i].file);
        fprintf(f, ", \"attn_rel_err\": ");
        json_rel(f, res[i].attn_num, res[i].attn_den);
        fprintf(f, ", \"key_rel_err\": ");
        json_rel(f, res[i].key_num, res[i].key_den);
        fprintf(f, ", \"value_rel_err\": ");
        json_rel(f, res[i].val_num, res[i].val_den);
        fprintf(f, ", \"effective_bits\": %.9g, \"compression_ratio\": %.9g, \"attn_layer_rel_err\": [",
                res[i].mem.effective_bits, res[i].mem.compression_ratio);
        for (int l = 0; l < in->L; l++) {
            fprintf(f, "%s", l ? ", " : "");
            json_rel(f, res[i].attn_layer_num[l], res[i].attn_layer_den[l]);
        }
        fprintf(f, "]}");
    }
    fprintf(f, "\n]}\n");
    if (fclose(f)) return kvq_tool_error("eval", "%s: write failed", json);
    snprintf(script, sizeof script, "%.4096s/python/kvq/plot.py", kvq_data_dir());
    const char *py = getenv("KVQ_PYTHON");
    py = py && *py ? py : "python3";
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) return kvq_tool_error("eval", "--plot: fork: %s", strerror(errno));
    if (pid == 0) {
        execlp(py, py, script, json, a->plot, (char *)NULL);
        fprintf(stderr, "kvq eval: --plot: cannot run %s: %s\n", py, strerror(errno));
        _exit(127);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
        return kvq_tool_error("eval", "--plot: %s %s failed (it needs matplotlib: pip install matplotlib, or set "
                              "KVQ_PYTHON to a python that has it); the data is in %s", py, script, json);
    if (!a->quiet) fprintf(stderr, "kvq eval: wrote %s (data: %s)\n", a->plot, json);
    return 0;
}

/* Lists the wanted schemes of every file. A scheme that comes twice from the same file (one spec includes a file
 * given on the command line as well) is listed once; two different schemes of one name are refused, since the
 * table and --out-dir name them. Returns 0, or -1 after printing why. */
static int list_schemes(const eval_args *a, kvq_spec **specs, eval_result *res, int *n)
{
    for (int f = 0; f < a->n_files; f++) {
        int count = kvq_spec_scheme_count(specs[f]);
        for (int i = 0; i < count; i++) {
            const kvq_scheme *s = kvq_spec_scheme_at(specs[f], i);
            int wanted = a->n_schemes == 0;
            for (int k = 0; k < a->n_schemes; k++) wanted |= !strcmp(a->schemes[k], kvq_scheme_name(s));
            if (!wanted) continue;
            char file[PATH_MAX];
            if (!realpath(s->file, file)) snprintf(file, sizeof file, "%s", s->file);
            int dup = 0;
            for (int j = 0; j < *n && !dup; j++) {
                if (strcmp(kvq_scheme_name(res[j].scheme), kvq_scheme_name(s))) continue;
                if (strcmp(res[j].file, file))
                    return kvq_tool_error("eval", "two schemes named '%s' (%s and %s): rename one", kvq_scheme_name(s),
                                          res[j].scheme->file, s->file);
                dup = 1;
            }
            if (dup) continue;
            if (*n == MAX_SCHEMES) return kvq_tool_error("eval", "at most %d schemes at once", MAX_SCHEMES);
            memset(&res[*n], 0, sizeof res[*n]);
            res[*n].scheme = s;
            snprintf(res[*n].file, sizeof res[*n].file, "%s", file);
            (*n)++;
        }
    }
    int defined = 0;
    for (int f = 0; f < a->n_files; f++) defined += kvq_spec_scheme_count(specs[f]);
    if (!defined) return kvq_tool_error("eval", "the given files define no scheme");
    for (int k = 0; k < a->n_schemes; k++) {
        int found = 0;
        for (int i = 0; i < *n; i++) found |= !strcmp(a->schemes[k], kvq_scheme_name(res[i].scheme));
        if (!found) return kvq_tool_error("eval", "no scheme '%s' in the given files", a->schemes[k]);
    }
    return 0;
}

/* --out-dir is made before anything runs, so a missing parent or a file in the way is reported at once
 * instead of after every scheme has run. */
static int make_out_dir(const char *dir)
{
    struct stat st;
    if (mkdir(dir, 0777) && errno != EEXIST) return kvq_tool_error("eval", "--out-dir %s: %s", dir, strerror(errno));
    if (stat(dir, &st) || !S_ISDIR(st.st_mode))
        return kvq_tool_error("eval", "--out-dir %s: exists and is not a directory", dir);
    return 0;
}

/* Exit status: 0 when every scheme ran, 1 when an input, a spec or a scheme failed, 2 for a usage error. */
int kvq_eval_main(int argc, char **argv)
{
    eval_args a;
    int r = parse_args(argc, argv, &a);
    if (r) {
        usage();
        return r < 0 ? 2 : 0;
    }
    kvq_spec *specs[MAX_FILES] = {0};
    static eval_result res[MAX_SCHEMES];
    int n = 0, rc = 0;
    eval_inputs in;
    memset(&in, 0, sizeof in);
    for (int f = 0; f < a.n_files; f++)
        if (!(specs[f] = tool_load_spec("kvq eval", a.files[f]))) {
            rc = 1;
            goto out;
        }
    if (list_schemes(&a, specs, res, &n) || (a.synthetic && model_dims_for_synth(&a, res, n)) ||
        (a.out_dir && make_out_dir(a.out_dir))) {
        rc = 1;
        goto out;
    }
    if (a.synthetic) fit_feature_counts(&a);
    if (load_inputs(&a, &in) || (!a.synthetic && model_dims_match_inputs(res, n, &in))) {
        rc = 1;
        goto out;
    }
    if (a.prefill >= in.T) {
        kvq_tool_error("eval", "--prefill %d leaves nothing to decode: the inputs hold %d tokens", a.prefill, in.T);
        rc = 2;
        goto out;
    }
    if (!a.backend_given) a.backend = kvq_tool_default_backend("eval");
    if (compute_exact(&a, &in)) {
        rc = 1;
        goto out;
    }
    for (int i = 0; i < n; i++)
        if (run_scheme(&a, &in, &res[i])) rc = 1;
    if (print_table(&a, &in, res, n)) rc = 1;
    if (a.plot && plot_results(&a, &in, res, n)) rc = 1;
out:
    free_inputs(&in);
    for (int f = 0; f < a.n_files; f++) kvq_spec_free(specs[f]);
    return rc;
}
