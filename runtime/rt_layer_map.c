/* kvq_engine_write_layer_map: the per-layer modes calibration decided (TailorKV Sec. 4.1, "offline
 * identification"), written back as a .kvq scheme that includes the engine's scheme file and inherits from it:
 *
 *   include "/abs/path/specs/tailorkv1.kvq";
 *   scheme NAME : tailorkv1 {
 *     layers 0..1 { mode quantize; }   # dense preference score ...
 *     layers 2..31 { mode sparse; }
 *   }
 *
 * Runs of consecutive auto layers with the same mode become one range; layers whose mode the scheme fixes are
 * left to inheritance. The include path is absolute so the map can be written anywhere (includes resolve
 * relative to the including file, docs/language.md). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "rt_internal.h"

static int valid_name(const char *s)
{
    if (!s || !((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || *s == '_')) return 0;
    for (const char *p = s + 1; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_' ||
              *p == '-'))
            return 0;
    return strlen(s) < KVQ_NAME_MAX;
}

static int quotable(const char *s)
{
    for (; *s; s++)
        if (*s == '"' || *s == '\\' || *s == '\n' || *s == '\r') return 0;
    return 1;
}

kvq_status kvq_engine_write_layer_map(kvq_engine *e, const char *path, const char *name)
{
    static const char fn[] = "kvq_engine_write_layer_map";
    if (!e) return KVQ_ERR_INVALID;
    if (!path || !name) return rt_error(e, KVQ_ERR_INVALID, "%s: %s is NULL", fn, path ? "name" : "path");
    if (!valid_name(name))
        return rt_error(e, KVQ_ERR_INVALID, "%s: '%s' is not a scheme name (letters, digits, _ and -)", fn, name);
    const kvq_scheme *s = e->scheme;
    if (strcmp(name, s->name) == 0)
        return rt_error(e, KVQ_ERR_INVALID, "%s: the map cannot have the name of the scheme it inherits ('%s')", fn,
                        name);
    if (!s->classify.enabled)
        return rt_error(e, KVQ_ERR_STATE,
                        "%s: scheme '%s' has no classify block: calibration decides no layer, there is no map to write",
                        fn, s->name);
    int L = e->cfg.dims.layers;
    for (int l = 0; l < L; l++)
        if (!e->layer_decided[l])
            return rt_error(e, KVQ_ERR_STATE, "%s: layer %d is not decided yet (calibrate it or prefill it first)", fn,
                            l);

    /* The included file must be the one the scheme came from: a scheme parsed from a string names no file
     * that exists (its name is only what diagnostics call the text). */
    char *real = realpath(s->file, NULL); /* malloc'd by libc */
    if (!real)
        return rt_error(e, KVQ_ERR_INVALID, "%s: scheme '%s' was not read from a file ('%s' does not exist), so the "
                        "map cannot include it", fn, s->name, s->file);
    char *abs = kvq_strdup(real);
    free(real);
    if (!abs) return rt_error(e, KVQ_ERR_NOMEM, "%s: out of memory", fn);
    if (!quotable(abs)) {
        kvq_free(abs);
        return rt_error(e, KVQ_ERR_INVALID, "%s: the path '%s' cannot be written as a .kvq string", fn, s->file);
    }

    FILE *f = fopen(path, "w");
    if (!f) {
        kvq_free(abs);
        return rt_error(e, KVQ_ERR_IO, "%s: cannot open '%s' for writing", fn, path);
    }
    fprintf(f, "# Per-layer modes decided by calibration (TailorKV Eq. 6-9: dense preference score P_l, quantize "
               "when P_l > tau = %g).\n",
            s->classify.tau);
    fprintf(f, "include \"%s\";\n", abs);
    fprintf(f, "scheme %s : %s {\n", name, s->name);
    for (int l = 0; l < L;) {
        if (!e->layer_auto[l]) {
            l++;
            continue;
        }
        int hi = l;
        while (hi + 1 < L && e->layer_auto[hi + 1] && e->layer_sparse[hi + 1] == e->layer_sparse[l]) hi++;
        fprintf(f, "  layers %d..%d { mode %s; }  # P =", l, hi, e->layer_sparse[l] ? "sparse" : "quantize");
        for (int j = l; j <= hi; j++) fprintf(f, " %.6g", e->layer_score[j]);
        fputc('\n', f);
        l = hi + 1;
    }
    fprintf(f, "}\n");
    kvq_free(abs);
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) return rt_error(e, KVQ_ERR_IO, "%s: error writing '%s'", fn, path);
    return KVQ_OK;
}
