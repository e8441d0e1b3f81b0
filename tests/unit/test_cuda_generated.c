/* generated/ is what `kvqc build` writes for every spec in specs/ and specs/paper/: the committed text part
 * (kernels.cu, kernels.h, and manifest.json up to its "resources", which depend on the NVRTC version) must equal
 * what the compiler emits now, so a change to the plan, the templates or emit_cuda shows up in the diff of the
 * commit that made it. Stale text fails with the file named; `make generated` refreshes it. Every directory in
 * generated/ must also belong to a scheme of a spec. And an engine of each scheme finds its generated/ unit
 * (cu_generated_matches, what the cuda backend's module load asks before NVRTC) when its model has another layer
 * count than the unit's, or the same: comments aside, the code is the same (issue 18, defect 6: the unit's
 * comment carried the layer count, so no engine ever loaded a generated cubin). Runs without NVRTC (nothing is
 * compiled). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu_dev.h"
#include "emit_cuda.h"
#include "harness.h"
#include "kvq.h"
#include "plan.h"

static char seen[128][KVQ_NAME_MAX];
static int n_seen;

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0, k;
    char *buf = kvq_malloc(cap);
    while (buf && (k = fread(buf + n, 1, cap - n - 1, f)) > 0) {
        n += k;
        if (n + 1 == cap) {
            char *t = kvq_realloc(buf, cap *= 2);
            if (!t) kvq_free(buf);
            buf = t;
        }
    }
    fclose(f);
    if (buf) buf[n] = 0;
    *len = n;
    return buf;
}

/* 1 if the committed file equals `want`, or for the manifest, equals it up to where resources are appended. */
static int same_text(const char *path, const char *want, size_t want_len, int manifest, long *first_diff)
{
    size_t n = 0;
    char *have = slurp(path, &n);
    if (!have) {
        *first_diff = -1;
        return 0;
    }
    size_t cmp_len = want_len;
    int ok;
    if (manifest) {
        /* want ends "\n  ]\n}\n"; the committed one may continue the kernels' "]" with resources */
        cmp_len = want_len >= 3 ? want_len - 3 : 0;
        ok = n >= cmp_len && memcmp(have, want, cmp_len) == 0 &&
             (strcmp(have + cmp_len, "\n}\n") == 0 || strncmp(have + cmp_len, ",\n  \"resources\": ", 17) == 0);
    } else {
        ok = n == want_len && memcmp(have, want, n) == 0;
    }
    *first_diff = 0;
    if (!ok) {
        size_t i = 0;
        while (i < n && i < cmp_len && have[i] == want[i]) i++;
        long line = 1;
        for (size_t j = 0; j < i; j++) line += want[j] == '\n';
        *first_diff = line;
    }
    kvq_free(have);
    return ok;
}

/* The unit an engine of scheme s emits (cu_backend.c's prepare: plan_build with the engine's dims, fp32 input). */
static char *engine_unit(const kvq_scheme *s, kvq_dims d)
{
    plan_default_dims(s, &d);
    kvq_plan *p = kvq_malloc(sizeof *p);
    char msg[256], *src = NULL;
    if (p && plan_build(s, &d, KVQ_F32, p, msg, sizeof msg) == KVQ_OK) emit_cuda_source(p, &src, NULL);
    kvq_free(p);
    return src;
}

/* Engines of the unit's model (32 heads, 8 kv heads, head_dim 128 unless the spec says otherwise) with the
 * unit's layer count, fewer and more find it; an engine of other heads does not (its code differs). */
static void check_engine_finds(const kvq_scheme *s)
{
    const char *name = kvq_scheme_name(s);
    const int layers[3] = {0, 28, 80}; /* 0: the unit's own (plan_default_dims) */
    for (int i = 0; i < 3; i++) {
        th_begin("an engine of %s with %d layers finds generated/%s", name, layers[i] ? layers[i] : 32, name);
        char *src = engine_unit(s, (kvq_dims){layers[i], 0, 0, 0});
        TH_CHECK(src != NULL, "plan/emit failed");
        if (src) TH_CHECK(cu_generated_matches(src, name), "generated/%s/kernels.cu is not the engine's unit", name);
        kvq_free(src);
        th_end();
    }
    th_begin("an engine of %s with other query heads does not take generated/%s", name, name);
    kvq_dims d = {0, 0, 0, 0};
    plan_default_dims(s, &d);
    char *src = engine_unit(s, (kvq_dims){0, d.kv_heads * (d.heads == d.kv_heads ? 2 : 1), d.kv_heads, 0});
    TH_CHECK(src != NULL, "plan/emit failed");
    if (src) TH_CHECK(!cu_generated_matches(src, name), "an engine of other heads matched generated/%s", name);
    kvq_free(src);
    th_end();
}

/* cu_source_same_code: comments count as one space; what is inside a string or character literal is code. */
static void check_same_code(void)
{
    th_begin("cu_source_same_code ignores comments, not code");
    static const struct {
        const char *a, *b;
        int same;
    } cases[] = {
        {"int x; /* 32 layers */\nint y;", "int x; /* 28 layers */\nint y;", 1},
        {"int x; // 32\nint y;", "int x; // 28 layers\nint y;", 1},
        {"int x;", "int x;", 1},
        {"int a/**/b;", "int a b;", 1},
        {"int ab;", "int a/**/b;", 0},
        {"int x = 1;", "int x = 2;", 0},
        {"s = \"/* a */\";", "s = \"/* b */\";", 0},
        {"c = '/'; /* a */", "c = '/'; /* b */", 1},
        {"s = \"\\\"/* a */\";", "s = \"\\\"/* b */\";", 0},
        {"int x; /* open", "int x; /* still open", 1},
        {"int x;", "int x; ", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        TH_CHECK(cu_source_same_code(cases[i].a, strlen(cases[i].a), cases[i].b, strlen(cases[i].b)) == cases[i].same,
                 "case %zu: \"%s\" vs \"%s\": expected %s", i, cases[i].a, cases[i].b,
                 cases[i].same ? "the same code" : "different code");
    th_end();
}

static void check_spec(const char *rel)
{
    kvq_spec *spec = NULL;
    if (kvq_spec_parse_file(th_path(rel), &spec) != KVQ_OK) {
        th_begin("generated: %s parses", rel);
        TH_CHECK(0, "%s does not parse", rel);
        th_end();
        kvq_spec_free(spec);
        return;
    }
    for (int i = 0; i < kvq_spec_scheme_count(spec); i++) {
        const kvq_scheme *s = kvq_spec_scheme_at(spec, i);
        th_begin("generated/%s is up to date with %s", kvq_scheme_name(s), rel);
        if (n_seen < 128) snprintf(seen[n_seen++], KVQ_NAME_MAX, "%s", kvq_scheme_name(s));
        kvq_dims d = {0, 0, 0, 0};
        plan_default_dims(s, &d);
        kvq_plan *p = kvq_malloc(sizeof *p);
        char msg[256];
        emit_cuda_text t;
        if (!p || plan_build(s, &d, KVQ_F32, p, msg, sizeof msg) != KVQ_OK ||
            emit_cuda_text_build(p, NULL, &t) != KVQ_OK) {
            TH_CHECK(0, "plan/emit failed");
        } else {
            const char *names[3] = {"kernels.cu", "kernels.h", "manifest.json"};
            const char *text[3] = {t.source, t.header, t.manifest};
            size_t lens[3] = {t.source_len, t.header_len, t.manifest_len};
            for (int f = 0; f < 3; f++) {
                char rel_path[256];
                long line;
                snprintf(rel_path, sizeof rel_path, "generated/%s/%s", kvq_scheme_name(s), names[f]);
                int ok = same_text(th_path(rel_path), text[f], lens[f], f == 2, &line);
                TH_CHECK(ok, "%s is %s (run `make generated`)", rel_path, line < 0 ? "missing" : "stale");
                if (!ok && line > 0) TH_CHECK(0, "%s: first difference at line %ld", rel_path, line);
            }
            emit_cuda_text_free(&t);
        }
        kvq_free(p);
        th_end();
        check_engine_finds(s);
    }
    kvq_spec_free(spec);
}

static void check_dir(const char *rel)
{
    DIR *d = opendir(th_path(rel));
    struct dirent *e;
    char *names[128];
    int n = 0;
    while (d && (e = readdir(d)) && n < 128) {
        size_t len = strlen(e->d_name);
        if (len > 4 && !strcmp(e->d_name + len - 4, ".kvq")) names[n++] = kvq_strdup(e->d_name);
    }
    if (d) closedir(d);
    for (int i = 0; i < n; i++) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", rel, names[i]);
        check_spec(p);
        kvq_free(names[i]);
    }
}

int main(void)
{
    setenv("KVQ_GENERATED_DIR", th_path("generated"), 1);
    check_same_code();
    check_dir("specs");
    check_dir("specs/paper");
    th_begin("generated/ holds only schemes of the specs");
    DIR *d = opendir(th_path("generated"));
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        int known = 0;
        for (int i = 0; i < n_seen; i++) known |= !strcmp(seen[i], e->d_name);
        TH_CHECK(known, "generated/%s belongs to no scheme of specs/ (remove it)", e->d_name);
    }
    TH_CHECK(d != NULL, "no generated/ directory");
    if (d) closedir(d);
    th_end();
    return th_summary();
}
