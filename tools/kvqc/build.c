/* kvqc build: a spec's schemes compiled ahead of time into generated/<scheme>/ (docs/cuda.md):
 *   kernels.cu      the translation unit (prelude + templates), what NVRTC compiles
 *   kernels.h       parameter structs, constants, kernel table and layer -> class map for a host program
 *   manifest.json   plan, kernels with parameters and launch shapes, source hash, resources per kernel and arch
 *   resources.txt   the resource report (registers, shared memory, stack, spills per kernel and arch)
 *   <arch>.cubin, <arch>.ptx   one per --arch (git-ignored in the repository)
 *   cost.txt        with --cost: the decode kernels' executed warp-instructions per token and per byte, from
 *                   a real decode step under the emulator mapped onto the cubin's SASS (tools/kvqc/cost.c)
 * The runtime loads <arch>.cubin when kernels.cu equals the source it would JIT. Without libnvrtc, or with
 * --no-compile, only the text part is written.
 * --target cpu (or all) writes the cpu backend's object instead (or as well), for this host or --cpu /
 * --cpu-features (docs/cpu.md, "Ahead of time"):
 *   cpu-<cpu>-<key16>.o   the kernels of the plan, compiled as the JIT would (git-ignored in the repository)
 *   cpu.json              a line per object: key, SHA-256, size, LLVM version, CPU, features, width, kernels
 * The runtime loads the object whose key equals the one it computes for its own module and host. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "cost.h"
#include "cpu/cpu_aot.h"
#include "cuda/cu.h"
#include "emit_llvm.h"
#include "emit_cuda.h"
#include "kvq.h"
#include "kvqc.h"
#include "tool_spec.h"
#include "plan.h"

#define MAX_ARCHS 8

typedef struct {
    const char *file, *scheme, *out;
    char archs[MAX_ARCHS][16];
    int n_archs, no_compile;
    int cpu, cuda; /* --target */
    const char *cpu_name, *cpu_features;
    kvq_dims dims;
    kvq_dtype input;
    int cost;               /* --cost: the cost model over an emulated decode step (cost.txt) */
    kvqc_cost_args cost_at; /* its workload (the batch: each of cost_batch in turn) */
    int cost_batch[8], n_cost_batch;
} build_args;

static void usage(void)
{
    fprintf(stdout,
            "usage: kvqc build FILE [--target cuda|cpu|all] [--scheme NAME] [--arch sm_80,sm_90] [-o DIR]\n"
            "                  [--layers L] [--heads H] [--kv-heads HKV] [--head-dim D] [--input f32|f16|bf16]\n"
            "                  [--no-compile] [--cpu NAME] [--cpu-features STR]\n"
            "                  [--cost [--cost-batch B[,B...]] [--cost-tokens T] [--cost-every-block]]\n"
            "  Writes DIR/<scheme>/ (DIR defaults to generated). --target cuda (the default): kernels.cu,\n"
            "  kernels.h, manifest.json, resources.txt, and a cubin plus PTX per architecture (NVRTC).\n"
            "  --target cpu: the cpu backend's object cpu-<cpu>-<key>.o and its line in cpu.json (LLVM), for this\n"
            "  host or for --cpu NAME / --cpu-features STR (LLVM's spellings; --cpu alone: that CPU's own\n"
            "  features). --target all: both. Every scheme of FILE unless --scheme.\n"
            "  Dimensions default to the scheme's `model { }` block, else 32 layers, 32 heads, 8 kv heads,\n"
            "  head_dim 128; inputs default to f32 (what the runtime's backends pass the kernels).\n"
            "  --cost: the decode kernels' executed warp-instructions per token and per byte, registers, shared\n"
            "  memory, CTAs and bytes in flight per SM, from one decode step of B sequences of T tokens (defaults\n"
            "  1 and 32768; a row per arch and B) run under the emulator, mapped onto the cubin's SASS by line, with\n"
            "  issue 22's targets met or not (cost.txt; slow: minutes a row). The sequences are alike: one is run,\n"
            "  standing for the batch (checked); --cost-every-block runs them all (the check's reference).\n");
}

static int parse_dim(const char *opt, const char *s, int *out)
{
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || end == s || *end || v < 1 || v > 65536) {
        fprintf(stderr, "kvqc build: %s expects a positive integer, got '%s'\n", opt, s ? s : "");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int parse_args(int argc, char **argv, build_args *a)
{
    memset(a, 0, sizeof *a);
    a->out = "generated";
    a->input = KVQ_F32;
    a->cost_at.batch = 1;
    a->cost_at.tokens = 32768;
    a->cost_batch[0] = 1, a->n_cost_batch = 1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            usage();
            return 1;
        }
        if (!strcmp(o, "--scheme") && v)
            a->scheme = argv[++i];
        else if (!strcmp(o, "-o") && v)
            a->out = argv[++i];
        else if (!strcmp(o, "--no-compile"))
            a->no_compile = 1;
        else if (!strcmp(o, "--cost"))
            a->cost = 1;
        else if (!strcmp(o, "--cost-every-block"))
            a->cost_at.every_block = 1;
        else if (!strcmp(o, "--cost-batch") && v) {
            char list[128];
            snprintf(list, sizeof list, "%s", argv[++i]);
            a->n_cost_batch = 0;
            for (char *t = strtok(list, ","); t; t = strtok(NULL, ",")) {
                if (a->n_cost_batch == (int)(sizeof a->cost_batch / sizeof a->cost_batch[0])) {
                    fprintf(stderr, "kvqc build: --cost-batch takes at most 8 batch sizes\n");
                    return -1;
                }
                if (parse_dim(o, t, &a->cost_batch[a->n_cost_batch++])) return -1;
            }
        } else if (!strcmp(o, "--cost-tokens") && v) {
            if (parse_dim(o, argv[++i], &a->cost_at.tokens)) return -1;
        }
        else if (!strcmp(o, "--target") && v) {
            const char *t = argv[++i];
            a->cpu = !strcmp(t, "cpu") || !strcmp(t, "all");
            a->cuda = !strcmp(t, "cuda") || !strcmp(t, "all");
            if (!a->cpu && !a->cuda) {
                fprintf(stderr, "kvqc build: --target expects cuda, cpu or all\n");
                return -1;
            }
        } else if ((!strcmp(o, "--cpu") || !strcmp(o, "--cpu-features")) && v) {
            const char *t = argv[++i];
            /* LLVM's CPU names and feature strings: letters, digits and - _ . (features also + and ,) */
            int feat = o[5] != 0;
            for (const char *c = t; *c; c++)
                if (!(*c >= 'a' && *c <= 'z') && !(*c >= 'A' && *c <= 'Z') && !(*c >= '0' && *c <= '9') &&
                    !strchr("-_.", *c) && !(feat && strchr("+,", *c))) {
                    fprintf(stderr, "kvqc build: %s: unexpected character '%c' in '%s'\n", o, *c, t);
                    return -1;
                }
            if (feat) a->cpu_features = t;
            else a->cpu_name = t;
        }
        else if (!strcmp(o, "--arch") && v) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                if (a->n_archs == MAX_ARCHS || strncmp(t, "sm_", 3) || strlen(t) > 7) {
                    fprintf(stderr, "kvqc build: bad architecture '%s' (sm_80, sm_90, ...)\n", t);
                    return -1;
                }
                snprintf(a->archs[a->n_archs++], 16, "%s", t);
            }
        } else if (!strcmp(o, "--layers") && v) {
            if (parse_dim(o, argv[++i], &a->dims.layers)) return -1;
        } else if (!strcmp(o, "--heads") && v) {
            if (parse_dim(o, argv[++i], &a->dims.heads)) return -1;
        } else if (!strcmp(o, "--kv-heads") && v) {
            if (parse_dim(o, argv[++i], &a->dims.kv_heads)) return -1;
        } else if (!strcmp(o, "--head-dim") && v) {
            if (parse_dim(o, argv[++i], &a->dims.head_dim)) return -1;
        } else if (!strcmp(o, "--input") && v) {
            const char *t = argv[++i];
            if (!strcmp(t, "f32"))
                a->input = KVQ_F32;
            else if (!strcmp(t, "f16"))
                a->input = KVQ_F16;
            else if (!strcmp(t, "bf16"))
                a->input = KVQ_BF16;
            else {
                fprintf(stderr, "kvqc build: --input expects f32, f16 or bf16\n");
                return -1;
            }
        } else if (o[0] == '-' || a->file) {
            fprintf(stderr, "kvqc build: unexpected argument '%s'\n", o);
            return -1;
        } else {
            a->file = o;
        }
    }
    if (!a->file) {
        fprintf(stderr, "kvqc build: no spec file (kvqc build --help)\n");
        return -1;
    }
    if (!a->cpu && !a->cuda) a->cuda = 1;
    if (a->n_archs == 0) {
        snprintf(a->archs[0], 16, "sm_80");
        snprintf(a->archs[1], 16, "sm_90");
        a->n_archs = 2;
    }
    return 0;
}

static int mkdirs(const char *path)
{
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST) return -1;
        *s = '/';
    }
    return mkdir(p, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

static int write_file(const char *dir, const char *name, const void *data, size_t n)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "kvqc build: cannot write %s: %s\n", path, strerror(errno));
        if (f) fclose(f);
        return -1;
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "kvqc build: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* Compiles for every arch, writes the binaries, fills the resources JSON and report. 0 ok. */
static int compile_archs(const build_args *a, const char *dir, const char *src, emit_buf *json, emit_buf *report)
{
    emit_buf_printf(json, "{\"nvrtc\": \"%s\"", cu_nvrtc_version());
    emit_buf_printf(report, "%-26s %-6s %5s %7s %6s %13s %9s\n", "kernel", "arch", "regs", "smem", "stack",
                    "spill st/ld", "barriers");
    for (int i = 0; i < a->n_archs; i++) {
        cu_compiled c;
        char msg[1024], *diag = NULL;
        if (cu_nvrtc_compile(src, a->archs[i], 1, &c, &diag, msg, sizeof msg) != KVQ_OK) {
            fprintf(stderr, "kvqc build: %s\n", msg);
            if (diag) fputs(diag, stderr);
            kvq_free(diag);
            return -1;
        }
        char name[64];
        snprintf(name, sizeof name, "%s.cubin", a->archs[i]);
        int rc = write_file(dir, name, c.cubin, c.cubin_size);
        snprintf(name, sizeof name, "%s.ptx", a->archs[i]);
        if (!rc) rc = write_file(dir, name, c.ptx, c.ptx_size);
        emit_buf_printf(json, ",\n    \"%s\": {", a->archs[i]);
        /* ptxas lists entries in its own order: report them sorted by name, so the text is stable */
        for (int x = 0; x < c.n_res; x++)
            for (int y = x + 1; y < c.n_res; y++)
                if (strcmp(c.res[x].name, c.res[y].name) > 0) {
                    cu_kernel_res t = c.res[x];
                    c.res[x] = c.res[y], c.res[y] = t;
                }
        for (int k = 0; k < c.n_res; k++) {
            const cu_kernel_res *r = &c.res[k];
            emit_buf_printf(json,
                            "%s\n      \"%s\": {\"registers\": %d, \"smem\": %d, \"stack\": %d, \"spill_stores\": %d, "
                            "\"spill_loads\": %d, \"lmem\": %d}",
                            k ? "," : "", r->name, r->regs, r->smem, r->stack, r->spill_stores, r->spill_loads,
                            r->lmem);
            emit_buf_printf(report, "%-26s %-6s %5d %7d %6d %6d/%-6d %9d\n", r->name, a->archs[i], r->regs, r->smem,
                            r->stack, r->spill_stores, r->spill_loads, r->barriers);
        }
        emit_buf_printf(json, "}");
        cu_compiled_free(&c);
        if (rc) return -1;
    }
    emit_buf_printf(json, "}");
    return json->failed || report->failed ? -1 : 0;
}

/* nvdisasm: $KVQ_NVDISASM; the one tools/ensure-sass-tools.sh installs in the build directory, found from
 * kvqc's own place (build/kvqc, or build/san/kvqc beside build/sass-tools) whatever the current directory; or
 * PATH's. */
static const char *find_sass_tool(const char *tool, const char *env, char *path, size_t size);
static const char *find_nvdisasm(void)
{
    static char path[PATH_MAX + 32];
    return find_sass_tool("nvdisasm", "KVQ_NVDISASM", path, sizeof path);
}
static const char *find_sass_tool(const char *tool, const char *env, char *path, size_t size)
{
    const char *e = getenv(env);
    if (e && *e) return access(e, X_OK) == 0 ? e : NULL;
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash) *slash = '\0';
        const char *rel[] = {"sass-tools", "../sass-tools"};
        for (int i = 0; i < 2; i++) {
            snprintf(path, size, "%s/%s/%s", self, rel[i], tool);
            if (access(path, X_OK) == 0) return path;
        }
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", tool);
    return system(cmd) == 0 ? tool : NULL;
}

/* --target cpu: the object of the plan's kernels (the cpu backend's list, compiler/emit_llvm_plan.c) for the
 * target, written with its cpu.json line (runtime/cpu/cpu_aot.c). 0 ok. */
static int build_cpu(const build_args *a, const kvq_plan *p, const char *dir)
{
    char msg[1024];
    emit_llvm_sources src[PLAN_MAX_CLASSES];
    int n = emit_llvm_plan_kernels(p, src, NULL);
    emit_llvm_kernel *ks = kvq_calloc((size_t)n, sizeof *ks);
    if (!ks) {
        fprintf(stderr, "kvqc build: out of memory\n");
        return 1;
    }
    emit_llvm_plan_kernels(p, src, ks);
    emit_llvm_target t = {a->cpu_name, a->cpu_features, 0};
    emit_llvm_module *m = NULL;
    void *obj = NULL;
    size_t size = 0;
    char name[256];
    int rc = 1;
    if (emit_llvm_module_build(ks, n, &t, &m, msg, sizeof msg) != KVQ_OK ||
        emit_llvm_module_object(m, &obj, &size, msg, sizeof msg) != KVQ_OK ||
        cpu_aot_write(dir, m, p, obj, size, name, sizeof name, msg, sizeof msg) != 0) {
        fprintf(stderr, "kvqc build: %s: cpu: %s\n", p->scheme, msg);
    } else {
        char llvm[32];
        emit_llvm_version(llvm, sizeof llvm);
        printf("%s/%s: %d kernel%s, LLVM %s, cpu %s, width %d, %zu bytes, key %s\n", dir, name, n, n == 1 ? "" : "s",
               llvm, emit_llvm_module_cpu(m), emit_llvm_module_width(m), size, emit_llvm_module_key(m));
        rc = 0;
    }
    kvq_free(obj);
    emit_llvm_module_free(m);
    kvq_free(ks);
    return rc;
}

static int build_scheme(const build_args *a, const kvq_scheme *sch, int can_compile)
{
    kvq_dims dims = a->dims;
    plan_default_dims(sch, &dims);
    kvq_plan *p = kvq_malloc(sizeof *p);
    char msg[512];
    if (!p) {
        fprintf(stderr, "kvqc build: out of memory\n");
        return 1;
    }
    if (plan_build(sch, &dims, a->input, p, msg, sizeof msg) != KVQ_OK) {
        fprintf(stderr, "kvqc build: %s: %s\n", kvq_scheme_name(sch), msg);
        kvq_free(p);
        return 1;
    }
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/%s", a->out, kvq_scheme_name(sch));
    int rc = 0;
    emit_cuda_text t;
    emit_buf json = {0}, report = {0}, cost = {0};
    if (mkdirs(dir) != 0) {
        fprintf(stderr, "kvqc build: cannot create %s: %s\n", dir, strerror(errno));
        rc = 1;
    } else if (a->cpu && (rc = build_cpu(a, p, dir)) != 0) {
        /* reported */
    } else if (!a->cuda) {
        /* cpu only */
    } else if (plan_cuda_ok(p, msg, sizeof msg) != KVQ_OK) {
        fprintf(stderr, "kvqc build: %s: %s\n", kvq_scheme_name(sch), msg);
        rc = 1;
    } else if (emit_cuda_text_build(p, NULL, &t) != KVQ_OK) {
        fprintf(stderr, "kvqc build: out of memory\n");
        rc = 1;
    } else {
        if (can_compile && compile_archs(a, dir, t.source, &json, &report) != 0) rc = 1;
        if (!rc && can_compile) {
            emit_cuda_text_free(&t);
            if (emit_cuda_text_build(p, json.s, &t) != KVQ_OK) rc = 1;
        }
        if (!rc)
            rc = write_file(dir, "kernels.cu", t.source, t.source_len) ||
                 write_file(dir, "kernels.h", t.header, t.header_len) ||
                 write_file(dir, "manifest.json", t.manifest, t.manifest_len);
        if (!rc && can_compile) rc = write_file(dir, "resources.txt", report.s, report.len);
        if (!rc && can_compile && a->cost) {
            const char *nvd = find_nvdisasm();
            if (!nvd) {
                fprintf(stderr, "kvqc build: --cost: no nvdisasm (tools/ensure-sass-tools.sh installs it)\n");
                rc = 1;
            } else {
                kvqc_cost_header(&a->cost_at, &cost);
                for (int i = 0; i < a->n_archs && !rc; i++)
                    for (int b = 0; b < a->n_cost_batch && !rc; b++) {
                        kvqc_cost_args at = a->cost_at;
                        at.batch = a->cost_batch[b];
                        rc = kvqc_cost(&at, sch, p, dir, t.source, a->archs[i], nvd, &cost) != 0;
                    }
                if (!rc) rc = write_file(dir, "cost.txt", cost.s, cost.len);
            }
        }
        if (!rc) {
            printf("%s: %d layer class%s, %d layers, %d/%d heads, head_dim %d", dir, p->n_classes,
                   p->n_classes == 1 ? "" : "es", p->layers, p->heads, p->kv_heads, p->head_dim);
            if (can_compile)
                for (int i = 0; i < a->n_archs; i++) printf(" %s", a->archs[i]);
            printf("\n");
            if (can_compile) fputs(report.s, stdout);
            if (cost.s) fputs(cost.s, stdout);
        }
        emit_cuda_text_free(&t);
    }
    emit_buf_free(&json);
    emit_buf_free(&report);
    emit_buf_free(&cost);
    kvq_free(p);
    return rc ? 1 : 0;
}

int kvqc_build_main(int argc, char **argv)
{
    build_args a;
    int pa = parse_args(argc, argv, &a);
    if (pa == 1) return 0; /* --help */
    if (pa != 0) return 2;
    kvq_spec *spec = tool_load_spec("kvqc build", a.file);
    if (!spec) return 1;
    int can_compile = !a.no_compile && a.cuda;
    char why[512];
    if (a.cpu && emit_llvm_probe(why, sizeof why) != KVQ_OK) {
        fprintf(stderr, "kvqc build: --target cpu: %s\n", why);
        kvq_spec_free(spec);
        return 1;
    }
    if (can_compile && cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        fprintf(stderr, "kvqc build: %s; writing the text part only\n", why);
        can_compile = 0;
    }
    int rc = 0, done = 0;
    for (int i = 0; i < kvq_spec_scheme_count(spec); i++) {
        const kvq_scheme *s = kvq_spec_scheme_at(spec, i);
        if (a.scheme && strcmp(a.scheme, kvq_scheme_name(s))) continue;
        rc |= build_scheme(&a, s, can_compile);
        done++;
    }
    if (a.scheme && !done) {
        fprintf(stderr, "kvqc build: %s has no scheme '%s'\n", a.file, a.scheme);
        rc = 1;
    }
    kvq_spec_free(spec);
    return rc;
}
