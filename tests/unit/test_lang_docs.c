/* Every example of docs/language.md is checked: a block fenced as ```kvq must parse without a single
 * diagnostic, one fenced as ```kvq-error must produce at least one error. In a valid block, a scheme named
 * X_written_out must resolve exactly like scheme X (that is how the Defaults table is tied to the code). Run
 * from the source directory, so examples can include specs/ files. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "kvq.h"
#include "scheme.h"

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    n = ftell(f);
    fseek(f, 0, SEEK_SET);
    buf = malloc((size_t)n + 1);
    if (fread(buf, 1, (size_t)n, f) != (size_t)n) n = 0;
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static int same_tensor(const kvq_tensor_cfg *a, const kvq_tensor_cfg *b)
{
    return a->bits == b->bits && a->gran == b->gran && a->channel_separable == b->channel_separable &&
           a->group == b->group && a->scale_dtype == b->scale_dtype && a->zero_dtype == b->zero_dtype &&
           a->format.kind == b->format.kind && a->format.codebook_normal == b->format.codebook_normal &&
           a->format.n_levels == b->format.n_levels && a->format.tensor_scale == b->format.tensor_scale &&
           !memcmp(a->format.levels, b->format.levels, sizeof a->format.levels) && a->rotate == b->rotate &&
           a->rotate_seed == b->rotate_seed && a->turboquant == b->turboquant && a->tq_outliers == b->tq_outliers &&
           a->tq_outlier_bits == b->tq_outlier_bits;
}

static int same_layer(const kvq_layer_cfg *a, const kvq_layer_cfg *b)
{
    const kvq_quant_cfg *p = &a->quant, *q = &b->quant;
    return a->mode == b->mode && same_tensor(&p->key, &q->key) && same_tensor(&p->value, &q->value) &&
           p->sinks == q->sinks && p->residual == q->residual && p->flush == q->flush &&
           p->outliers.keep == q->outliers.keep && p->outliers.metric == q->outliers.metric &&
           p->outliers.spill == q->outliers.spill && p->saliency.metric == q->saliency.metric &&
           p->saliency.probe_recent == q->saliency.probe_recent &&
           p->saliency.probe_random == q->saliency.probe_random && p->saliency.salient == q->saliency.salient &&
           p->saliency.high_bits == q->saliency.high_bits && p->saliency.low_bits == q->saliency.low_bits &&
           p->saliency.interval == q->saliency.interval && a->sparse.host_offload == b->sparse.host_offload &&
           a->sparse.sinks == b->sparse.sinks && a->sparse.recent == b->sparse.recent &&
           a->sparse.topk == b->sparse.topk && a->sparse.critical_channels == b->sparse.critical_channels;
}

static int same_scheme(const kvq_scheme *a, const kvq_scheme *b)
{
    if (a->model.layers != b->model.layers || a->model.heads != b->model.heads ||
        a->model.kv_heads != b->model.kv_heads || a->model.head_dim != b->model.head_dim)
        return 0;
    if (a->classify.enabled != b->classify.enabled || a->classify.queries != b->classify.queries ||
        a->classify.top != b->classify.top || a->classify.tau != b->classify.tau)
        return 0;
    if (!same_layer(&a->base, &b->base) || a->n_ranges != b->n_ranges) return 0;
    for (int i = 0; i < a->n_ranges; i++)
        if (a->ranges[i].lo != b->ranges[i].lo || a->ranges[i].hi != b->ranges[i].hi ||
            !same_layer(&a->ranges[i].cfg, &b->ranges[i].cfg))
            return 0;
    return 1;
}

static int written_out_pairs(const kvq_spec *spec)
{
    static const char suffix[] = "_written_out";
    int pairs = 0;
    for (int i = 0; i < kvq_spec_scheme_count(spec); i++) {
        const kvq_scheme *w = kvq_spec_scheme_at(spec, i), *s;
        size_t n = strlen(w->name);
        char base[KVQ_NAME_MAX];
        if (n <= sizeof suffix - 1 || strcmp(w->name + n - (sizeof suffix - 1), suffix)) continue;
        snprintf(base, sizeof base, "%.*s", (int)(n - (sizeof suffix - 1)), w->name);
        s = kvq_spec_scheme(spec, base);
        TH_CHECK(s != NULL, "no scheme %s for %s", base, w->name);
        if (s) TH_CHECK(same_scheme(s, w), "%s does not resolve like %s", w->name, base);
        pairs++;
    }
    return pairs;
}

static int n_pairs;

static void check_block(const char *text, size_t len, int line, int want_error)
{
    char name[64];
    kvq_spec *spec = NULL;
    kvq_status st;
    snprintf(name, sizeof name, "language.md:%d", line);
    th_begin("docs: %s example at docs/language.md:%d", want_error ? "error" : "valid", line);
    st = kvq_spec_parse_string(name, text, len, &spec);
    if (want_error) {
        TH_CHECK(st == KVQ_ERR_SPEC && kvq_spec_error_count(spec) > 0, "expected an error, got %s", kvq_status_str(st));
    } else {
        TH_CHECK(st == KVQ_OK, "status %s", kvq_status_str(st));
        for (int i = 0; i < kvq_spec_diag_count(spec); i++) {
            char buf[512];
            kvq_diag_format(kvq_spec_diag(spec, i), buf, sizeof buf);
            TH_CHECK(0, "%s", buf);
        }
        TH_CHECK(kvq_spec_scheme_count(spec) > 0, "no scheme");
        n_pairs += written_out_pairs(spec);
    }
    kvq_spec_free(spec);
    th_end();
}

int main(void)
{
    char *doc, *p;
    int line = 1, valid = 0, errors = 0;
    if (chdir(th_srcdir()) != 0 || !(doc = read_text("docs/language.md"))) {
        printf("FAIL docs: cannot read docs/language.md under %s\n", th_srcdir());
        return 1;
    }
    for (p = doc; *p;) {
        char *eol = strchr(p, '\n');
        size_t n = eol ? (size_t)(eol - p) : strlen(p);
        int kind = 0; /* 1 valid, 2 error */
        if (n == 6 && !strncmp(p, "```kvq", 6)) kind = 1;
        if (n == 12 && !strncmp(p, "```kvq-error", 12)) kind = 2;
        if (kind) {
            char *body = eol ? eol + 1 : p + n, *q = body;
            int start = line + 1;
            /* The block runs to the next line that is exactly ```. */
            while (*q && !(q[0] == '`' && !strncmp(q, "```", 3) && (q[3] == '\n' || q[3] == '\0'))) {
                char *e = strchr(q, '\n');
                line++;
                q = e ? e + 1 : q + strlen(q);
            }
            check_block(body, (size_t)(q - body), start, kind == 2);
            if (kind == 1)
                valid++;
            else
                errors++;
            p = q;
            continue;
        }
        line++;
        p = eol ? eol + 1 : p + n;
    }
    th_begin("docs: docs/language.md has checked examples (%d valid, %d error)", valid, errors);
    TH_CHECK(valid >= 10 && errors >= 5, "too few examples");
    TH_CHECK(n_pairs >= 3, "the Defaults section's written-out schemes are missing (%d pairs)", n_pairs);
    th_end();
    free(doc);
    return th_summary();
}
