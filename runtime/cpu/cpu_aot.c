/* Prebuilt cpu kernels (cpu_aot.h, docs/cpu.md "Ahead of time"): the file names and cpu.json that `kvqc build
 * --target cpu` writes and the runtime reads, in one place. cpu.json holds one object a line, so the reader
 * needs no JSON parser: it finds the line of its key and reads the object's name, SHA-256 and size from it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "read_file.h"
#include "cpu.h"
#include "cpu_aot.h"
#include "emit_cuda.h" /* emit_cuda_sha256_hex: the one SHA-256 of the project */
#include "rt_internal.h"

extern const kvq_backend kvq_backend_cpu;

void cpu_aot_dir(const char *scheme, char *out, size_t size) { kvq_generated_dir(scheme, out, size); }


/* The string value of "name": "..." within [line, end) into out; 0 when absent or too long. */
static int field_str(const char *line, const char *end, const char *name, char *out, size_t size)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\": \"", name);
    const char *p = strstr(line, pat);
    if (!p || p >= end) return 0;
    p += strlen(pat);
    const char *q = memchr(p, '"', (size_t)(end - p));
    if (!q || (size_t)(q - p) >= size) return 0;
    memcpy(out, p, (size_t)(q - p));
    out[q - p] = 0;
    return 1;
}

/* The line of `key` in a cpu.json text: [*line, *end), 1 if found. */
static int find_line(const char *text, const char *key, const char **line, const char **end)
{
    for (const char *l = text; *l;) {
        const char *e = strchr(l, '\n');
        if (!e) e = l + strlen(l);
        char k[80];
        if (field_str(l, e, "key", k, sizeof k) && !strcmp(k, key)) {
            *line = l, *end = e;
            return 1;
        }
        l = *e ? e + 1 : e;
    }
    return 0;
}

void *cpu_aot_find(const char *dir, const char *key, size_t *size)
{
    if (!key[0]) return NULL;
    char path[4400], name[256], sha[80], got[65];
    size_t n = 0;
    snprintf(path, sizeof path, "%s/cpu.json", dir);
    char *text = kvq_read_file(path, &n);
    if (!text) return NULL;
    const char *line, *end, *sz;
    int ok = find_line(text, key, &line, &end) && field_str(line, end, "object", name, sizeof name) &&
             field_str(line, end, "sha256", sha, sizeof sha) && !strchr(name, '/') &&
             (sz = strstr(line, "\"size\": ")) != NULL && sz < end;
    long long want = ok ? atoll(sz + 8) : -1;
    kvq_free(text);
    if (!ok) return NULL;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    void *obj = kvq_read_file(path, &n);
    if (!obj) return NULL;
    emit_cuda_sha256_hex(obj, n, got);
    if ((long long)n != want || strcmp(got, sha)) {
        kvq_free(obj); /* truncated or corrupt: a miss */
        return NULL;
    }
    *size = n;
    return obj;
}

/* A source as "fp16" or "2b-token-g32" (bits, granularity, group, separable, masked, parameter dtypes). */
static void source_text(const kvq_page_format *f, int fp16, char *out, size_t size)
{
    if (fp16) {
        snprintf(out, size, "fp16");
        return;
    }
    char g[32] = "";
    if (f->gran == KVQ_GRAN_TOKEN) snprintf(g, sizeof g, f->hidden ? "-hidden" : "-g%d", f->group);
    snprintf(out, size, "%db-%s%s%s%s%s", f->bits, f->gran == KVQ_GRAN_CHANNEL ? "channel" : "token", g,
             f->channel_separable ? "-sep" : "", f->masked ? "-masked" : "",
             f->scale_bytes == 4 || f->zero_bytes == 4 ? "-fp32" : "");
}

int cpu_aot_write(const char *dir, const emit_llvm_module *m, const kvq_plan *p, const void *obj, size_t size,
                  char *name, size_t name_size, char *msg, size_t msg_size)
{
    const char *key = emit_llvm_module_key(m), *cpu = emit_llvm_module_cpu(m);
    if (!key[0]) {
        snprintf(msg, msg_size, "the module has no key");
        return -1;
    }
    /* The CPU name in a file name: LLVM's names are [a-z0-9-_.]; anything else becomes '_'. */
    char safe[64];
    snprintf(safe, sizeof safe, "%s", cpu[0] ? cpu : "generic");
    for (char *c = safe; *c; c++)
        if (!(*c >= 'a' && *c <= 'z') && !(*c >= 'A' && *c <= 'Z') && !(*c >= '0' && *c <= '9') && *c != '-' &&
            *c != '_' && *c != '.')
            *c = '_';
    snprintf(name, name_size, "cpu-%s-%.16s.o", safe, key);
    char path[4400], tmp[4500];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    int w = f && fwrite(obj, 1, size, f) == size;
    if (f && fclose(f) != 0) w = 0;
    if (!w || rename(tmp, path) != 0) {
        snprintf(msg, msg_size, "cannot write %s: %s", path, strerror(errno));
        unlink(tmp);
        return -1;
    }

    /* This object's line. */
    emit_buf line = {0};
    char sha[65], llvm[32];
    emit_cuda_sha256_hex(obj, size, sha);
    emit_llvm_version(llvm, sizeof llvm);
    emit_buf_printf(&line,
                    "  {\"object\": \"%s\", \"key\": \"%s\", \"sha256\": \"%s\", \"size\": %zu, \"generator\": \"%s\", "
                    "\"llvm\": \"%s\", \"cpu\": \"%s\", \"width\": %d, \"dims\": [%d, %d, %d, %d], \"kernels\": [",
                    name, key, sha, size, EMIT_LLVM_KVQ_VERSION, llvm, cpu, emit_llvm_module_width(m), p->layers,
                    p->heads, p->kv_heads, p->head_dim);
    emit_llvm_sources src[PLAN_MAX_CLASSES];
    emit_llvm_plan_kernels(p, src, NULL);
    for (int c = 0, k = 0; c < p->n_classes; c++)
        for (int i = 0; i < src[c].n_k; i++)
            for (int j = 0; j < src[c].n_v; j++, k++) {
                char ks[64], vs[64];
                source_text(&src[c].kf[i], i == 0, ks, sizeof ks);
                source_text(&src[c].vf[j], j == 0, vs, sizeof vs);
                emit_buf_printf(&line, "%s\"kvq_tile_%d: c%d %s/%s\"", k ? ", " : "", k, c, ks, vs);
            }
    emit_buf_printf(&line, "], \"features\": \"%s\"}", emit_llvm_module_features(m));

    /* cpu.json: the other keys' lines whose objects are still there, then this one. */
    emit_buf out = {0};
    emit_buf_printf(&out, "{\"scheme\": \"%s\", \"objects\": [\n", p->scheme);
    snprintf(path, sizeof path, "%s/cpu.json", dir);
    size_t n = 0;
    char *old = kvq_read_file(path, &n);
    for (const char *l = old; l && *l;) {
        const char *e = strchr(l, '\n');
        if (!e) e = l + strlen(l);
        char k[80], o[256], op[4700];
        if (field_str(l, e, "key", k, sizeof k) && strcmp(k, key) && field_str(l, e, "object", o, sizeof o) &&
            !strchr(o, '/')) {
            snprintf(op, sizeof op, "%s/%s", dir, o);
            if (access(op, R_OK) == 0) {
                size_t len = (size_t)(e - l);
                while (len && (l[len - 1] == ',' || l[len - 1] == ' ')) len--;
                emit_buf_printf(&out, "%.*s,\n", (int)len, l);
            }
        }
        l = *e ? e + 1 : e;
    }
    kvq_free(old);
    emit_buf_printf(&out, "%s\n]}\n", line.s);
    int rc = -1;
    if (!out.failed && !line.failed) {
        snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
        f = fopen(tmp, "wb");
        w = f && fwrite(out.s, 1, out.len, f) == out.len;
        if (f && fclose(f) != 0) w = 0;
        if (w && rename(tmp, path) == 0) rc = 0;
        else unlink(tmp);
    }
    if (rc) snprintf(msg, msg_size, "cannot write %s: %s", path, out.failed ? "out of memory" : strerror(errno));
    emit_buf_free(&line);
    emit_buf_free(&out);
    return rc;
}

const char *cpu_engine_origin(const kvq_engine *e)
{
    if (!e || e->be != &kvq_backend_cpu || !e->ctx) return NULL;
    const cpu_state *s = e->ctx->ext;
    return s ? s->origin : NULL;
}
