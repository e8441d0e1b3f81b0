/* What the kvq subcommands share besides spec loading (tools/common): backend names, the default backend (the
 * cpu backend where this libkvq has it and it runs here, else the reference), and comma-separated integer lists
 * (--tokens 16384,65536). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq_tool.h"
#include "tool_spec.h"

int kvq_tool_backend(const char *cmd, const char *name, kvq_backend_kind *out)
{
    static const struct {
        const char *name;
        kvq_backend_kind kind;
    } names[] = {{"reference", KVQ_BACKEND_REFERENCE},
                 {"cpu", KVQ_BACKEND_CPU},
                 {"cuda", KVQ_BACKEND_CUDA},
                 {"emu", KVQ_BACKEND_EMU}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i].name)) {
            *out = names[i].kind;
            return 0;
        }
    return kvq_tool_error(cmd, "unknown backend '%s' (reference, cpu, cuda, emu)", name);
}

/* The scheme of specs/fp16.kvq: the smallest scheme every backend runs. */
static const char fp16_text[] = "scheme fp16 { bits 16; }\n";

kvq_status kvq_tool_probe_backend(kvq_backend_kind kind, char *why, size_t why_size)
{
    kvq_spec *spec = NULL;
    kvq_status st = kvq_spec_parse_string("<probe>", fp16_text, strlen(fp16_text), &spec);
    if (st != KVQ_OK) {
        snprintf(why, why_size, "%s", kvq_status_str(st));
        kvq_spec_free(spec);
        return st;
    }
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){1, 1, 1, 64};
    cfg.backend = kind;
    cfg.threads = 1;
    kvq_engine *e = NULL;
    st = kvq_engine_create(kvq_spec_scheme(spec, NULL), &cfg, &e, why, why_size);
    kvq_engine_free(e);
    kvq_spec_free(spec);
    return st;
}

kvq_backend_kind kvq_tool_default_backend(const char *cmd)
{
    char why[512];
    if (kvq_tool_probe_backend(KVQ_BACKEND_CPU, why, sizeof why) == KVQ_OK) return KVQ_BACKEND_CPU;
    fprintf(stderr, "kvq %s: note: running on the reference backend (%s)\n", cmd, why);
    return KVQ_BACKEND_REFERENCE;
}

int kvq_tool_int_list(const char *cmd, const char *opt, const char *s, int lo, int hi, int *out, int max, int *n)
{
    char item[64], full[64];
    snprintf(full, sizeof full, "kvq %s", cmd);
    *n = 0;
    for (const char *p = s;; p++) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (*n == max) return kvq_tool_error(cmd, "%s takes at most %d values", opt, max);
        if (len >= sizeof item) len = sizeof item - 1;
        memcpy(item, p, len);
        item[len] = '\0';
        if (tool_int(full, opt, item, lo, hi, &out[(*n)++])) return -1;
        if (!comma) return 0;
        p = comma;
    }
}

void kvq_tool_json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f);
    }
    fputc('"', f);
}
