/* kvqc report == runtime stats, byte for byte: for every scheme of every spec in specs/ (and specs/paper/), at
 * small dims, for several prompt lengths (below the residual, not a multiple of the group, several groups),
 * kvq_scheme_account's figures equal kvq_engine_stats after a prefill of a batch through the reference backend.
 * TailorKV's auto layers are calibrated by the prefill itself; the decided map goes to the accounting. */
#include <dirent.h>

#include "test_engine_util.h"

enum { LAYERS = 3, HEADS = 4, KV_HEADS = 2, D = 128, BATCH = 2, MAXT = 300 };

static const int lengths[] = {1, 7, 31, 33, 100, 161, 300};

static void compare(const char *what, const kvq_mem_stats *a, const kvq_mem_stats *r)
{
    for (int k = 0; k < KVQ_SEG_COUNT; k++) {
        TH_CHECK(a->bytes[k] == r->bytes[k], "%s: %s bytes: report %llu, runtime %llu", what,
                 kvq_segment_name((kvq_segment)k), (unsigned long long)a->bytes[k], (unsigned long long)r->bytes[k]);
        TH_CHECK(a->tokens[k] == r->tokens[k], "%s: %s tokens: report %llu, runtime %llu", what,
                 kvq_segment_name((kvq_segment)k), (unsigned long long)a->tokens[k], (unsigned long long)r->tokens[k]);
    }
    TH_CHECK(a->device_bytes == r->device_bytes && a->fp16_bytes == r->fp16_bytes, "%s: device %llu/%llu fp16 %llu/%llu",
             what, (unsigned long long)a->device_bytes, (unsigned long long)r->device_bytes,
             (unsigned long long)a->fp16_bytes, (unsigned long long)r->fp16_bytes);
    TH_CHECK(a->effective_bits == r->effective_bits && a->compression_ratio == r->compression_ratio,
             "%s: effective bits %.9g/%.9g", what, a->effective_bits, r->effective_bits);
}

static void check_scheme(const char *file, const kvq_scheme *sch, const kvq_synth *syn)
{
    th_begin("account == runtime: %s scheme %s, T in {1, 7, 31, 33, 100, 161, 300}, batch %d", file,
             kvq_scheme_name(sch), BATCH);
    size_t kvn = (size_t)KV_HEADS * MAXT * D, qn = (size_t)HEADS * MAXT * D;
    float *k = malloc(kvn * sizeof *k), *v = malloc(kvn * sizeof *v), *q = malloc(qn * sizeof *q);
    uint16_t *hk = malloc(kvn * 2), *hv = malloc(kvn * 2), *hq = malloc(qn * 2);
    for (size_t li = 0; li < sizeof lengths / sizeof lengths[0] && !th_failed(); li++) {
        int T = lengths[li];
        kvq_engine *e = tu_engine(sch, LAYERS, HEADS, KV_HEADS, D, KVQ_F16);
        if (!e) break;
        kvq_seq *seqs[BATCH];
        for (int b = 0; b < BATCH; b++) TH_CHECK(kvq_seq_create(e, &seqs[b]) == KVQ_OK, "seq create");
        for (int l = 0; l < LAYERS && !th_failed(); l++) {
            /* Each sequence its own slice of the synthetic prompt, so the items differ. */
            kvq_prefill_item items[BATCH];
            uint16_t *bufs[BATCH][3];
            for (int b = 0; b < BATCH; b++) {
                tu_slice(syn->k, l, KV_HEADS, syn->params.tokens, D, b * 7, T, k);
                tu_slice(syn->v, l, KV_HEADS, syn->params.tokens, D, b * 7, T, v);
                tu_slice(syn->q, l, HEADS, syn->params.tokens, D, b * 7, T, q);
                for (int t = 0; t < 3; t++)
                    bufs[b][t] = malloc((t == 2 ? (size_t)HEADS : (size_t)KV_HEADS) * (size_t)T * D * 2);
                tu_to_f16(k, (size_t)KV_HEADS * T * D, bufs[b][0]);
                tu_to_f16(v, (size_t)KV_HEADS * T * D, bufs[b][1]);
                tu_to_f16(q, (size_t)HEADS * T * D, bufs[b][2]);
                items[b] = (kvq_prefill_item){seqs[b], T, bufs[b][0], bufs[b][1], bufs[b][2]};
            }
            kvq_status st = kvq_prefill(e, l, items, BATCH);
            TH_CHECK(st == KVQ_OK, "T=%d layer %d prefill: %s", T, l, kvq_engine_errmsg(e));
            for (int b = 0; b < BATCH; b++)
                for (int t = 0; t < 3; t++) free(bufs[b][t]);
        }
        unsigned char sparse[LAYERS];
        for (int l = 0; l < LAYERS; l++) sparse[l] = kvq_engine_layer_state(e, l) == KVQ_LAYER_SPARSE;
        kvq_account_opts opts;
        memset(&opts, 0, sizeof opts);
        opts.auto_sparse = sparse;
        kvq_dims dims = {LAYERS, HEADS, KV_HEADS, D};
        kvq_mem_stats acc, run;
        TH_CHECK(kvq_scheme_account(sch, &dims, BATCH, T, &opts, &acc) == KVQ_OK, "account");
        TH_CHECK(kvq_engine_stats(e, &run) == KVQ_OK, "stats");
        char what[64];
        snprintf(what, sizeof what, "T=%d", T);
        compare(what, &acc, &run);
        /* One sequence's own stats are half the batch's (same lengths, same layout). */
        kvq_mem_stats one;
        TH_CHECK(kvq_seq_stats(e, seqs[0], &one) == KVQ_OK && one.device_bytes * BATCH == run.device_bytes,
                 "T=%d: one sequence %llu bytes, batch %llu", T, (unsigned long long)one.device_bytes,
                 (unsigned long long)run.device_bytes);
        kvq_engine_free(e);
    }
    free(k), free(v), free(q), free(hk), free(hv), free(hq);
    th_end();
}

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void check_dir(const char *rel, const kvq_synth *syn, int *n_schemes)
{
    DIR *d = opendir(th_path(rel));
    if (!d) return;
    char *names[256];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 256) {
        size_t len = strlen(de->d_name);
        if (len > 4 && strcmp(de->d_name + len - 4, ".kvq") == 0) names[n++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], by_name);
    for (int i = 0; i < n; i++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s", rel, names[i]);
        kvq_spec *spec = NULL;
        if (kvq_spec_parse_file(th_path(path), &spec) == KVQ_OK) {
            for (int j = 0; j < kvq_spec_scheme_count(spec); j++) {
                check_scheme(path, kvq_spec_scheme_at(spec, j), syn);
                (*n_schemes)++;
            }
        } else {
            th_begin("account == runtime: %s parses", path);
            TH_CHECK(0, "does not check");
            th_end();
        }
        kvq_spec_free(spec);
        free(names[i]);
    }
}

int main(void)
{
    kvq_synth_params p = kvq_synth_params_default();
    p.layers = LAYERS;
    p.heads = HEADS;
    p.kv_heads = KV_HEADS;
    p.head_dim = D;
    p.tokens = MAXT + 7 * BATCH;
    p.outlier_channels = 3;
    kvq_synth syn;
    char err[256];
    th_begin("account == runtime: synthetic K/V/Q");
    TH_CHECK(kvq_synth_generate(&p, &syn, err, sizeof err) == KVQ_OK, "synth: %s", err);
    th_end();
    int n = 0;
    check_dir("specs", &syn, &n);
    check_dir("specs/paper", &syn, &n);
    check_dir("specs/formats", &syn, &n);
    th_begin("account == runtime: every spec covered (%d schemes)", n);
    TH_CHECK(n >= 8, "only %d schemes found under specs/", n);
    th_end();
    kvq_synth_free(&syn);
    return th_summary();
}
