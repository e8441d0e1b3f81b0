/* Every shipped spec compiles with NVRTC at head_dim 128, and ptxas reports no spills, no stack frame and no local
 * memory for its decode-attention kernels and its policy kernels (OTT's competition, ZipCache's, TailorKV's; every
 * policy kernel appears in some spec; the resource report is printed): specs/, specs/paper/ and
 * specs/rotate/turboquant* for sm_80 and sm_90; specs/formats/, specs/compare/ and the other specs/rotate/ specs
 * for sm_90, the emulated GPU (their kernels are the element formats' and the unrotated specs' code, which the
 * first group compiles for sm_80 too). A scheme whose unit is the same source as one already listed (a rotation
 * happens on the host: kivi-hadamard's units are KIVI's) is compiled once and named in the report. This program is
 * where the emulator programs' units are checked with NVRTC: most of them load units without the figures
 * (tests/test-times `res=0`, docs/testing.md "Test time"). Also: a failed compile returns the options, the NVRTC log and the numbered source; the JIT cache
 * treats truncated and corrupt entries as misses; the resource parser reads ptxas's lines. Without libnvrtc the
 * compile cases print "skipped: <reason>" (not PASS) and the program exits 0. Compiles run in two processes and
 * through $KVQ_CACHE_DIR. */
#include <dirent.h>
#include <sys/wait.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "cuda/cu.h"
#include "emit_cuda.h"
#include "harness.h"
#include "kvq.h"
#include "plan.h"

#define MAX_JOBS 128

typedef struct {
    char label[160];
    char *src;
    const char *arch;
    kvq_plan *plan;
    kvq_status st;
    char msg[1024];
    cu_compiled out;
} job;

static job jobs[MAX_JOBS];
static int n_jobs;

/* NVRTC serialises compiles inside one process, so two child processes warm the cache with half the jobs each;
 * the parent then compiles everything through the cache (hits, or a compile of its own when caching is off). */
static void warm_cache_in_children(void)
{
    pid_t pid[2];
    for (int w = 0; w < 2; w++) {
        pid[w] = fork();
        if (pid[w] == 0) {
            for (int i = w; i < n_jobs; i += 2) {
                cu_compiled out;
                char msg[256];
                if (cu_nvrtc_compile(jobs[i].src, jobs[i].arch, 1, &out, NULL, msg, sizeof msg) == KVQ_OK)
                    cu_compiled_free(&out);
            }
            _exit(0);
        }
    }
    for (int w = 0; w < 2; w++)
        if (pid[w] > 0) waitpid(pid[w], NULL, 0);
    for (int i = 0; i < n_jobs; i++)
        jobs[i].st =
            cu_nvrtc_compile(jobs[i].src, jobs[i].arch, 1, &jobs[i].out, NULL, jobs[i].msg, sizeof jobs[i].msg);
}

/* A job compiling the same source (but for its first line, the comment naming the scheme), or NULL. */
static const job *same_source(const char *src)
{
    const char *body = strchr(src, '\n');
    for (int i = 0; body && i < n_jobs; i++) {
        const char *other = strchr(jobs[i].src, '\n');
        if (other && !strcmp(body, other)) return &jobs[i];
    }
    return NULL;
}

/* The schemes of every .kvq file in dir whose name starts with prefix (NULL: every file), for sm_80 and sm_90
 * (n_arch 2) or sm_90 only (1). */
static void add_spec_jobs(const char *dir, const char *prefix, int n_arch)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    char *names[64];
    int nn = 0;
    while (d && (e = readdir(d)) && nn < 64) {
        size_t len = strlen(e->d_name);
        int want = !prefix || !strncmp(e->d_name, prefix, strlen(prefix));
        if (len > 4 && strcmp(e->d_name + len - 4, ".kvq") == 0 && want) names[nn++] = kvq_strdup(e->d_name);
    }
    if (d) closedir(d);
    for (int a = 0; a < nn; a++) /* sorted, so the report reads the same every run */
        for (int b = a + 1; b < nn; b++)
            if (strcmp(names[a], names[b]) > 0) {
                char *t = names[a];
                names[a] = names[b], names[b] = t;
            }
    for (int f = 0; f < nn; f++) {
        char path[600];
        snprintf(path, sizeof path, "%s/%s", dir, names[f]);
        kvq_spec *spec = NULL;
        if (kvq_spec_parse_file(path, &spec) != KVQ_OK) {
            th_begin("nvrtc: %s parses", names[f]);
            TH_CHECK(0, "%s does not parse", path);
            th_end();
            kvq_spec_free(spec);
            kvq_free(names[f]);
            continue;
        }
        for (int s = 0; s < kvq_spec_scheme_count(spec); s++) {
            const kvq_scheme *sc = kvq_spec_scheme_at(spec, s);
            kvq_dims dims = {0, 0, 0, 128};
            plan_default_dims(sc, &dims);
            dims.head_dim = 128; /* the resource criterion is stated at head_dim 128 */
            kvq_plan *p = kvq_malloc(sizeof *p);
            char msg[256];
            char *src = NULL;
            if (!p || plan_build(sc, &dims, KVQ_F32, p, msg, sizeof msg) != KVQ_OK ||
                emit_cuda_source(p, &src, NULL) != KVQ_OK) {
                th_begin("nvrtc: plan and emit %s", kvq_scheme_name(sc));
                TH_CHECK(0, "plan/emit failed: %s", p ? msg : "no memory");
                th_end();
                kvq_free(p);
                continue;
            }
            const job *same = same_source(src);
            if (same) {
                printf("  %s/%s: the same unit as %s (compiled once)\n", names[f], kvq_scheme_name(sc), same->label);
                kvq_free(src);
                kvq_free(p);
                continue;
            }
            for (int a = 2 - n_arch; a < 2 && n_jobs + 1 < MAX_JOBS; a++) {
                job *j = &jobs[n_jobs++];
                snprintf(j->label, sizeof j->label, "%s/%s", names[f], kvq_scheme_name(sc));
                j->src = a == 2 - n_arch ? src : kvq_strdup(src);
                j->arch = a == 0 ? "sm_80" : "sm_90";
                j->plan = a == 2 - n_arch ? p : NULL;
            }
        }
        kvq_spec_free(spec);
        kvq_free(names[f]);
    }
}

static int is_policy(const char *name)
{
    return !strncmp(name, "kvq_ott_", 8) || !strncmp(name, "kvq_zip_", 8) || !strncmp(name, "kvq_tk_", 7);
}

static void report_jobs(void)
{
    /* the policy kernels every sm must have compiled somewhere: [kernel][arch] */
    static const char *const pol[] = {"kvq_ott_compete",  "kvq_ott_undo",   "kvq_zip_stats",  "kvq_zip_stats_max", "kvq_zip_saliency",
                                      "kvq_zip_row",      "kvq_zip_rowsal", "kvq_zip_select", "kvq_tk_absmax",
                                      "kvq_tk_select",    "kvq_tk_dense"};
    enum { NPOL = sizeof pol / sizeof pol[0] };
    int seen[NPOL][2];
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < n_jobs; i++) {
        job *j = &jobs[i];
        th_begin("nvrtc: %s compiles for %s with no spills or local memory in decode and policy kernels", j->label,
                 j->arch);
        TH_CHECK(j->st == KVQ_OK, "%s", j->msg);
        int decode = 0;
        for (int r = 0; r < j->out.n_res; r++) {
            const cu_kernel_res *k = &j->out.res[r];
            int is_decode = strncmp(k->name, "kvq_decode_c", 12) == 0;
            printf("  %-40s %-6s %-22s %3d regs %6d smem %3d stack %3d/%3d spill%s\n", j->label, j->arch, k->name,
                   k->regs, k->smem, k->stack, k->spill_stores, k->spill_loads, j->out.from_cache ? " (cached)" : "");
            for (int q = 0; q < NPOL; q++)
                if (!strcmp(k->name, pol[q])) seen[q][strcmp(j->arch, "sm_80") != 0] = 1;
            if (!is_decode && !is_policy(k->name)) continue;
            decode += is_decode;
            /* decode kernels with 4 blocks an SM (128 registers, plan_decode_min_blocks) may keep a value or two
             * outside their loops in local memory (KIVI-2 on sm_90: 8 bytes stored, 16 loaded; docs/cuda.md "Tuning
             * knobs"); anything more is a regression */
            const int sp = is_decode ? 16 : 0;
            TH_CHECK(k->spill_stores <= sp && k->spill_loads <= 2 * sp, "%s spills %d/%d bytes", k->name,
                     k->spill_stores, k->spill_loads);
            TH_CHECK(k->stack <= sp && k->lmem <= sp, "%s uses local memory: %d bytes stack, %d lmem", k->name,
                     k->stack, k->lmem);
            TH_CHECK(k->regs > 0 && k->regs <= 255, "%s: %d registers", k->name, k->regs);
        }
        TH_CHECK(j->st != KVQ_OK || decode > 0, "no decode kernel in the resource report");
        th_end();
        cu_compiled_free(&j->out);
        kvq_free(j->src);
        kvq_free(j->plan);
    }
    th_begin("nvrtc: every policy kernel compiled for sm_80 and sm_90 with no spills or local memory");
    for (int q = 0; q < NPOL; q++)
        TH_CHECK(seen[q][0] && seen[q][1], "%s: sm_80 %s, sm_90 %s", pol[q], seen[q][0] ? "yes" : "no",
                 seen[q][1] ? "yes" : "no");
    th_end();
}

static void test_failure_text(void)
{
    th_begin("nvrtc: a failed compile returns options, log and numbered source");
    const char *bad = "extern \"C\" __global__ void k(int *p)\n{\n    p[0] = undefined_thing;\n}\n";
    cu_compiled out;
    char *diag = NULL, msg[1024];
    kvq_status st = cu_nvrtc_compile(bad, "sm_80", 1, &out, &diag, msg, sizeof msg);
    TH_CHECK(st == KVQ_ERR_INTERNAL, "status %d", st);
    TH_CHECK(strstr(msg, "undefined_thing") != NULL, "message lacks the error: %s", msg);
    TH_CHECK(diag && strstr(diag, "--gpu-architecture=sm_80"), "diagnostic lacks the options");
    TH_CHECK(diag && strstr(diag, "    3      p[0] = undefined_thing;"), "diagnostic lacks the numbered source");
    TH_CHECK(diag && strstr(diag, "---- log ----"), "diagnostic lacks the log");
    kvq_free(diag);
    th_end();
}

static void test_cache(void)
{
    th_begin("nvrtc: cache hit, then truncated and corrupt entries are misses and rebuilt");
    const char *src = "extern \"C\" __global__ void kvq_cache_probe(int *p) { p[threadIdx.x] = 7; }\n";
    cu_compiled a, b;
    char msg[512];
    TH_CHECK(cu_nvrtc_compile(src, "sm_80", 1, &a, NULL, msg, sizeof msg) == KVQ_OK, "%s", msg);
    TH_CHECK(cu_nvrtc_compile(src, "sm_80", 1, &b, NULL, msg, sizeof msg) == KVQ_OK, "%s", msg);
    TH_CHECK(b.from_cache, "second compile not served by the cache");
    TH_CHECK(a.cubin_size == b.cubin_size && memcmp(a.cubin, b.cubin, a.cubin_size) == 0, "cached cubin differs");
    cu_compiled_free(&b);
    /* find the entry: the newest *.cubin in the cache dir holding our kernel name */
    const char *dir = kvq_cache_dir();
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[4200] = "";
    while (d && (e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 7 || strcmp(e->d_name + len - 6, ".cubin")) continue;
        char p[4200];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        FILE *f = fopen(p, "rb");
        if (!f) continue;
        static char buf[1 << 20];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        for (size_t i = 0; i + 15 < n; i++)
            if (memcmp(buf + i, "kvq_cache_probe", 15) == 0) {
                snprintf(path, sizeof path, "%s", p);
                break;
            }
        if (path[0]) break;
    }
    if (d) closedir(d);
    TH_CHECK(path[0], "cache entry not found in %s", dir);
    if (path[0]) {
        TH_CHECK(truncate(path, 100) == 0, "truncate");
        TH_CHECK(cu_nvrtc_compile(src, "sm_80", 1, &b, NULL, msg, sizeof msg) == KVQ_OK, "%s", msg);
        TH_CHECK(!b.from_cache, "truncated entry was a hit");
        cu_compiled_free(&b);
        FILE *f = fopen(path, "r+b");
        if (f) {
            fseek(f, 200, SEEK_SET);
            fputc(0x5a, f);
            fclose(f);
        }
        TH_CHECK(cu_nvrtc_compile(src, "sm_80", 1, &b, NULL, msg, sizeof msg) == KVQ_OK, "%s", msg);
        TH_CHECK(!b.from_cache, "corrupt entry was a hit");
        cu_compiled_free(&b);
        TH_CHECK(cu_nvrtc_compile(src, "sm_80", 1, &b, NULL, msg, sizeof msg) == KVQ_OK && b.from_cache,
                 "rebuilt entry not cached");
        cu_compiled_free(&b);
    }
    cu_compiled_free(&a);
    th_end();
}

static void test_parse(void)
{
    th_begin("nvrtc: ptxas resource lines parse");
    const char *log = "ptxas info    : 0 bytes gmem\n"
                      "ptxas info    : Compiling entry function 'kvq_decode_c0' for 'sm_90'\n"
                      "ptxas info    : Function properties for kvq_decode_c0\n"
                      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                      "ptxas info    : Used 80 registers, used 1 barriers, 36864 bytes smem\n"
                      "ptxas info    : Compiling entry function 'kvq_quant_k_hi_c0' for 'sm_80'\n"
                      "    24 bytes stack frame, 20 bytes spill stores, 52 bytes spill loads\n"
                      "ptxas info    : Used 32 registers, used 1 barriers, 24 bytes cumulative stack size, "
                      "8704 bytes smem\n";
    cu_kernel_res *r;
    int n = cu_parse_resources(log, &r);
    TH_CHECK(n == 2, "%d kernels", n);
    if (n == 2) {
        TH_CHECK(!strcmp(r[0].name, "kvq_decode_c0") && !strcmp(r[0].arch, "sm_90"), "name/arch");
        TH_CHECK(r[0].regs == 80 && r[0].smem == 36864 && r[0].stack == 0 && r[0].barriers == 1, "figures 0");
        TH_CHECK(r[1].regs == 32 && r[1].stack == 24 && r[1].spill_stores == 20 && r[1].spill_loads == 52 &&
                     r[1].smem == 8704,
                 "figures 1");
    }
    kvq_free(r);
    th_end();
}

int main(void)
{
    char why[512];
    test_parse();
    if (cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        printf("skipped: %s\n", why);
        return th_summary();
    }
    printf("NVRTC %s, cache %s\n", cu_nvrtc_version(), kvq_cache_dir());
    add_spec_jobs(th_path("specs"), NULL, 2);
    add_spec_jobs(th_path("specs/paper"), NULL, 2);
    /* TurboQuant's kernels (templates/kvq_turboquant.cuh) */
    add_spec_jobs(th_path("specs/rotate"), "turboquant", 2);
    /* the element formats (templates/kvq_format.cuh), the comparison specs and the other rotated specs (the
     * unrotated kernels: mostly the same units as above), for the emulated GPU */
    add_spec_jobs(th_path("specs/formats"), NULL, 1);
    add_spec_jobs(th_path("specs/compare"), NULL, 1);
    add_spec_jobs(th_path("specs/rotate"), "kivi", 1);
    add_spec_jobs(th_path("specs/rotate"), "per-token", 1);
    warm_cache_in_children();
    report_jobs();
    test_failure_text();
    test_cache();
    return th_summary();
}
