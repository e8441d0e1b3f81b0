/* kvqc report: the memory of a cache after a prefill, by segment, from the one accounting module
 * (kvq_scheme_account) the runtime allocates by. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq.h"
#include "kvqc.h"
#include "tool_spec.h"
#include "lloyd_max.h" /* the MSE of a codebook on N(0,1) */
#include "quant.h"     /* element formats: which have a tensor scale */
#include "scheme.h"    /* model dims given in the spec, auto (calibrated) layers */

#define MAX_REPORT_LAYERS 4096

typedef struct {
    const char *file, *scheme;
    kvq_dims dims;
    int batch, seq, json;
    kvq_account_opts opts;
    unsigned char sparse[MAX_REPORT_LAYERS];
    int have_sparse;
} report_args;

static void usage(void)
{
    fprintf(stderr,
            "usage: kvqc report FILE [--scheme NAME] --layers L --heads H --kv-heads HKV --head-dim D\n"
            "                   --batch B --seq T [--json] [--share-channel-params] [--sparse-layers LIST]\n"
            "  Memory of the cache after a prefill of T tokens per sequence, by segment, effective bits per\n"
            "  element (metadata included) and the compression ratio against fp16. Dimensions default to the\n"
            "  scheme's `model { }` block.\n"
            "  --share-channel-params  count per-channel metadata once for the whole batch (ZipCache App. A)\n"
            "  --sparse-layers LIST    layers a calibration made sparse, e.g. 0,2-5 (auto layers otherwise\n"
            "                          count as quantized)\n");
}

/* "0,2-5,7" -> sparse[0] = sparse[2..5] = sparse[7] = 1. */
static int parse_layer_list(const char *s, unsigned char *sparse)
{
    const char *p = s;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10), b = a;
        if (end == p || a < 0 || a >= MAX_REPORT_LAYERS) goto bad;
        p = end;
        if (*p == '-') {
            b = strtol(p + 1, &end, 10);
            if (end == p + 1 || b < a || b >= MAX_REPORT_LAYERS) goto bad;
            p = end;
        }
        for (long l = a; l <= b; l++) sparse[l] = 1;
        if (*p == ',')
            p++;
        else if (*p)
            goto bad;
    }
    return 0;
bad:
    fprintf(stderr, "kvqc report: --sparse-layers expects a list like 0,2-5, got '%s'\n", s);
    return -1;
}

static int parse_args(int argc, char **argv, report_args *a)
{
    memset(a, 0, sizeof *a);
    a->dims.layers = a->dims.heads = a->dims.kv_heads = a->dims.head_dim = -1;
    a->batch = 1;
    a->seq = -1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int r = 0;
        if (!strcmp(o, "--json")) {
            a->json = 1;
            continue;
        }
        if (!strcmp(o, "--share-channel-params")) {
            a->opts.share_channel_params_across_batch = 1;
            continue;
        }
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            usage();
            return 1;
        }
        if (o[0] != '-') {
            if (a->file) {
                fprintf(stderr, "kvqc report: one spec file at a time ('%s' and '%s')\n", a->file, o);
                return -1;
            }
            a->file = o;
            continue;
        }
        if (!v) {
            fprintf(stderr, "kvqc report: %s needs a value\n", o);
            return -1;
        }
        if (!strcmp(o, "--scheme"))
            a->scheme = v;
        else if (!strcmp(o, "--layers"))
            r = tool_int("kvqc report", o, v, 1, MAX_REPORT_LAYERS, &a->dims.layers);
        else if (!strcmp(o, "--heads"))
            r = tool_int("kvqc report", o, v, 1, 4096, &a->dims.heads);
        else if (!strcmp(o, "--kv-heads"))
            r = tool_int("kvqc report", o, v, 1, 4096, &a->dims.kv_heads);
        else if (!strcmp(o, "--head-dim"))
            r = tool_int("kvqc report", o, v, 1, 4096, &a->dims.head_dim);
        else if (!strcmp(o, "--batch"))
            r = tool_int("kvqc report", o, v, 1, 1 << 20, &a->batch);
        else if (!strcmp(o, "--seq"))
            r = tool_int("kvqc report", o, v, 0, INT_MAX / 2, &a->seq);
        else if (!strcmp(o, "--sparse-layers")) {
            r = parse_layer_list(v, a->sparse);
            a->have_sparse = 1;
        } else {
            fprintf(stderr, "kvqc report: unknown option '%s'\n", o);
            return -1;
        }
        if (r) return -1;
        i++;
    }
    if (!a->file) {
        fprintf(stderr, "kvqc report: no spec file given\n");
        return -1;
    }
    if (a->seq < 0) {
        fprintf(stderr, "kvqc report: --seq T is required\n");
        return -1;
    }
    if (a->have_sparse) a->opts.auto_sparse = a->sparse;
    return 0;
}

/* Flags override the spec's model block; every dimension must come from one of them. */
static int resolve_dims(const report_args *a, const kvq_scheme *s, kvq_dims *d)
{
    const kvq_model_dims *m = &s->model;
    d->layers = a->dims.layers > 0 ? a->dims.layers : m->layers;
    d->heads = a->dims.heads > 0 ? a->dims.heads : m->heads;
    d->kv_heads = a->dims.kv_heads > 0 ? a->dims.kv_heads : (m->kv_heads ? m->kv_heads : d->heads);
    d->head_dim = a->dims.head_dim > 0 ? a->dims.head_dim : m->head_dim;
    const char *missing = d->layers <= 0 ? "--layers" : d->heads <= 0 ? "--heads" : d->head_dim <= 0 ? "--head-dim" : NULL;
    if (missing) {
        fprintf(stderr, "kvqc report: scheme '%s': %s not given and the spec has no model block setting it\n",
                s->name, missing);
        return -1;
    }
    /* The engine's own check (kvq_scheme_check_dims): report accepts exactly the dims the engine runs. */
    char msg[512];
    if (kvq_scheme_check_dims(s, d, msg, sizeof msg) != KVQ_OK) {
        fprintf(stderr, "kvqc report: scheme '%s': %s\n", s->name, msg);
        return -1;
    }
    return 0;
}

static int count_auto_layers(const kvq_scheme *s, int layers)
{
    int n = 0;
    for (int l = 0; l < layers; l++) n += kvq_scheme_layer(s, l)->mode == KVQ_MODE_AUTO;
    return n;
}

/* One tensor's element format in words ("" for asymmetric integers, the default, so that reports of integer
 * schemes read as before). */
static void describe_format(const kvq_tensor_cfg *t, char *buf, size_t n)
{
    const kvq_format_cfg *f = &t->format;
    size_t len = 0;
    int w;
    buf[0] = '\0';
    if (kvq_bits_is_fp16(t->bits) || f->kind == KVQ_FMT_INT) return;
    w = snprintf(buf, n, "%s%s, %d-bit codes", kvq_format_name(f->kind),
                 f->kind == KVQ_FMT_CODEBOOK ? (f->codebook_normal ? " normal" : " (explicit)") : "", t->bits);
    if (w > 0 && (size_t)w < n) len = (size_t)w;
    if (kvq_format_has_tensor_scale(f->kind)) {
        if (f->tensor_scale > 0)
            w = snprintf(buf + len, n - len, ", tensor scale %g", f->tensor_scale);
        else
            w = snprintf(buf + len, n - len, ", tensor scale from the prompt");
        if (w > 0 && (size_t)w < n - len) len += (size_t)w;
    }
    if (f->kind == KVQ_FMT_CODEBOOK) {
        double lv[KVQ_CODEBOOK_MAX];
        w = snprintf(buf + len, n - len, "; levels");
        if (w > 0 && (size_t)w < n - len) len += (size_t)w;
        for (int i = 0; i < f->n_levels; i++) {
            lv[i] = f->levels[i];
            w = snprintf(buf + len, n - len, " %.6g", f->levels[i]);
            if (w > 0 && (size_t)w < n - len) len += (size_t)w;
        }
        /* The levels are for N(0,1) (normal) or for the group scaled to max |level| (explicit): their MSE on
         * N(0,1) is the figure to compare with Lloyd-Max's. */
        w = snprintf(buf + len, n - len, " (MSE for N(0,1): %.6g)", kvq_normal_quant_mse(lv, f->n_levels, 1.0));
        if (w > 0 && (size_t)w < n - len) len += (size_t)w;
    }
}

static void print_formats(const kvq_scheme *s, int layers)
{
    char prev[2][512] = {"", ""}, cur[2][512];
    int from = 0;
    for (int l = 0; l <= layers; l++) {
        if (l < layers) {
            const kvq_layer_cfg *c = kvq_scheme_layer(s, l);
            describe_format(&c->quant.key, cur[0], sizeof cur[0]);
            describe_format(&c->quant.value, cur[1], sizeof cur[1]);
            if (c->mode == KVQ_MODE_SPARSE) cur[0][0] = cur[1][0] = '\0';
            if (l > 0 && !strcmp(cur[0], prev[0]) && !strcmp(cur[1], prev[1])) continue;
        }
        if (l > 0 && (prev[0][0] || prev[1][0])) {
            const char *what[2] = {"keys", "values"};
            for (int k = 0; k < 2; k++)
                if (prev[k][0])
                    printf("  %s, layers %d..%d: format %s\n", what[k], from, l - 1, prev[k]);
        }
        if (l < layers) {
            memcpy(prev, cur, sizeof prev);
            from = l;
        }
    }
}

static void print_text(const report_args *a, const kvq_scheme *s, const kvq_dims *d, const kvq_mem_stats *m)
{
    printf("scheme %s (%s:%d)\n", s->name, s->file, s->line);
    printf("  layers %d, heads %d, kv heads %d, head_dim %d, batch %d, prefill %d tokens%s\n", d->layers, d->heads,
           d->kv_heads, d->head_dim, a->batch, a->seq,
           a->opts.share_channel_params_across_batch ? ", channel parameters shared across the batch" : "");
    int autos = count_auto_layers(s, d->layers);
    if (autos && !a->have_sparse)
        printf("  note: %d auto layer(s) counted as quantized; pass --sparse-layers to count a calibrated map\n",
               autos);
    print_formats(s, d->layers);
    printf("  %-14s %14s %16s %10s\n", "segment", "K/V vectors", "bytes", "MiB");
    for (int k = 0; k < KVQ_SEG_COUNT; k++) {
        if (!m->bytes[k] && !m->tokens[k]) continue;
        printf("  %-14s %14llu %16llu %10.3f\n", kvq_segment_name((kvq_segment)k), (unsigned long long)m->tokens[k],
               (unsigned long long)m->bytes[k], (double)m->bytes[k] / 1048576.0);
    }
    printf("  %-14s %14s %16llu %10.3f\n", "device total", "", (unsigned long long)m->device_bytes,
           (double)m->device_bytes / 1048576.0);
    printf("  %-14s %14s %16llu %10.3f\n", "fp16 cache", "", (unsigned long long)m->fp16_bytes,
           (double)m->fp16_bytes / 1048576.0);
    printf("  effective bits per element: %.3f\n", m->effective_bits);
    printf("  compression ratio vs fp16:  %.3f\n", m->compression_ratio);
}

static void json_string(const char *s)
{
    putchar('"');
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    putchar('"');
}

static void print_json(const report_args *a, const kvq_scheme *s, const kvq_dims *d, const kvq_mem_stats *m)
{
    printf("{\"scheme\": ");
    json_string(s->name);
    printf(", \"file\": ");
    json_string(s->file);
    printf(", \"layers\": %d, \"heads\": %d, \"kv_heads\": %d, \"head_dim\": %d, \"batch\": %d, \"seq\": %d, "
           "\"share_channel_params\": %s, \"auto_layers\": %d, \"segments\": {",
           d->layers, d->heads, d->kv_heads, d->head_dim, a->batch, a->seq,
           a->opts.share_channel_params_across_batch ? "true" : "false", count_auto_layers(s, d->layers));
    for (int k = 0; k < KVQ_SEG_COUNT; k++)
        printf("%s\"%s\": {\"bytes\": %llu, \"vectors\": %llu}", k ? ", " : "", kvq_segment_name((kvq_segment)k),
               (unsigned long long)m->bytes[k], (unsigned long long)m->tokens[k]);
    printf("}, \"device_bytes\": %llu, \"fp16_bytes\": %llu, \"effective_bits\": %.6f, \"compression_ratio\": %.6f}",
           (unsigned long long)m->device_bytes, (unsigned long long)m->fp16_bytes, m->effective_bits,
           m->compression_ratio);
}

int kvqc_report_main(int argc, char **argv)
{
    report_args a;
    int r = parse_args(argc, argv, &a);
    if (r) {
        if (r < 0) usage();
        return r < 0 ? 2 : 0;
    }
    kvq_spec *spec = tool_load_spec("kvqc report", a.file);
    if (!spec) return 1;
    int first = 0, last = kvq_spec_scheme_count(spec) - 1;
    if (last < 0) {
        fprintf(stderr, "kvqc report: %s defines no scheme\n", a.file);
        kvq_spec_free(spec);
        return 1;
    }
    if (a.scheme) {
        const kvq_scheme *want = kvq_spec_scheme(spec, a.scheme);
        if (!want) {
            fprintf(stderr, "kvqc report: %s has no scheme '%s'\n", a.file, a.scheme);
            kvq_spec_free(spec);
            return 1;
        }
        for (first = 0; kvq_spec_scheme_at(spec, first) != want; first++) {
        }
        last = first;
    }
    int rc = 0;
    if (a.json) printf("[");
    for (int i = first; i <= last; i++) {
        const kvq_scheme *s = kvq_spec_scheme_at(spec, i);
        kvq_dims d;
        kvq_mem_stats m;
        if (resolve_dims(&a, s, &d)) {
            rc = 1;
            break;
        }
        kvq_status st = kvq_scheme_account(s, &d, a.batch, a.seq, &a.opts, &m);
        if (st != KVQ_OK) {
            /* dims were checked above: what is left is a size beyond 2^63 - 1 bytes */
            fprintf(stderr, "kvqc report: scheme '%s': %s\n", s->name,
                    st == KVQ_ERR_INVALID ? "the cache's size does not fit 63 bits (more than 2^63 - 1 bytes or "
                                            "vectors); lower --batch, --seq or the dims"
                                          : kvq_status_str(st));
            rc = 1;
            break;
        }
        if (a.json) {
            if (i > first) printf(",\n ");
            print_json(&a, s, &d, &m);
        } else {
            if (i > first) putchar('\n');
            print_text(&a, s, &d, &m);
        }
    }
    if (a.json) printf("]\n");
    kvq_spec_free(spec);
    return rc;
}
