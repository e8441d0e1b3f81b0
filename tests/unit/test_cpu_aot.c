/* The cpu backend's kernels built ahead of time (docs/cpu.md, "Ahead of time"): `kvqc build --target cpu` of
 * specs/kivi2.kvq into a scratch directory writes an object and cpu.json; an engine whose data directory
 * ($KVQ_SRCDIR) or $KVQ_GENERATED_DIR points there loads that object (cpu_engine_origin says "generated") and its
 * decode outputs equal, bit for bit, those of an engine that compiled its kernels; a corrupted, truncated or
 * unloadable object is a miss (the engine compiles, same outputs, no crash); objects built for other CPU
 * features or another CPU have other keys and are never loaded. Without LLVM every case prints SKIP. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "cpu/cpu_aot.h"
#include "emit_cuda.h"
#include "emit_llvm.h"
#include "test_engine_util.h"
#include "tool_run.h"

#define L 1
#define H 8
#define HKV 2
#define D 64
#define PROMPT 300
#define STEPS 40

static char kvqc[PATH_MAX + 8], tmp[] = "/tmp/kvq_test_cpu_aot_XXXXXX";
static float out_ref[STEPS][H * D];

/* Runs kvqc build --target cpu for kivi2 at the test's dims into dir, with extra args (NULL-terminated, up to 4). */
static int build(const char *dir, const char *a1, const char *a2)
{
    const char *args[20] = {"build", "specs/kivi2.kvq", "--target", "cpu", "-o", dir, "--layers", "1", "--heads",
                            "8", "--kv-heads", "2", "--head-dim", "64"};
    int n = 14;
    if (a1) args[n++] = a1;
    if (a2) args[n++] = a2;
    args[n] = NULL;
    th_run_result r = th_run(kvqc, tmp, args, 120);
    th_run_check_clean(&r);
    TH_CHECK(r.status == 0, "kvqc build --target cpu exited %d:\n%s%s", r.status, r.out, r.err);
    int st = r.status;
    th_run_free(&r);
    return st;
}

/* An engine of kivi2 run for PROMPT + STEPS tokens; its decode outputs to out, its kernels' origin to origin. */
static void run_engine(const kvq_scheme *sch, float (*out)[H * D], char *origin, size_t origin_size)
{
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = KVQ_BACKEND_CPU;
    cfg.dims = (kvq_dims){L, H, HKV, D};
    cfg.dtype = KVQ_F32;
    cfg.threads = 1;
    kvq_engine *e = NULL;
    kvq_seq *s = NULL;
    char err[512];
    snprintf(origin, origin_size, "none");
    kvq_status st = kvq_engine_create(sch, &cfg, &e, err, sizeof err);
    TH_CHECK(st == KVQ_OK, "engine: %s: %s", kvq_status_str(st), err);
    if (st != KVQ_OK) return;
    snprintf(origin, origin_size, "%s", cpu_engine_origin(e) ? cpu_engine_origin(e) : "(null)");
    float *k = malloc(sizeof(float) * HKV * PROMPT * D), *v = malloc(sizeof(float) * HKV * PROMPT * D);
    float q[H * D], kd[HKV * D], vd[HKV * D];
    tu_rng = 0x2545f4914f6cdd1dull;
    tu_fill(k, (size_t)HKV * PROMPT * D, 1.0f);
    tu_fill(v, (size_t)HKV * PROMPT * D, 1.0f);
    st = kvq_seq_create(e, &s);
    kvq_prefill_item pi = {s, PROMPT, k, v, NULL};
    if (st == KVQ_OK) st = kvq_prefill(e, 0, &pi, 1);
    for (int t = 0; t < STEPS && st == KVQ_OK; t++) {
        tu_fill(q, H * D, 1.0f);
        tu_fill(kd, HKV * D, 1.0f);
        tu_fill(vd, HKV * D, 1.0f);
        kvq_decode_item di = {s, kd, vd, q, out[t]};
        st = kvq_decode(e, 0, &di, 1);
    }
    TH_CHECK(st == KVQ_OK, "run: %s: %s", kvq_status_str(st), kvq_engine_errmsg(e));
    free(k);
    free(v);
    kvq_engine_free(e);
}

/* One engine from generated dir `gen` (NULL: none): origin and outputs checked. */
static void check_engine(const kvq_scheme *sch, const char *gen, const char *want_origin, int want)
{
    static float out[STEPS][H * D];
    char origin[32];
    if (gen) setenv("KVQ_GENERATED_DIR", gen, 1);
    run_engine(sch, out, origin, sizeof origin);
    unsetenv("KVQ_GENERATED_DIR");
    if (want) TH_CHECK(!strcmp(origin, want_origin), "kernels from %s, expected %s", origin, want_origin);
    else TH_CHECK(strcmp(origin, want_origin) != 0, "kernels from %s", origin);
    TH_CHECK(!memcmp(out, out_ref, sizeof out), "decode outputs differ from the JIT-built engine's");
}

/* The path of the one object in dir (cpu-*.o), 0 if found. */
static int object_path(const char *dir, char *out, size_t size)
{
    char cmd[PATH_MAX + 64];
    snprintf(cmd, sizeof cmd, "ls '%s'/cpu-*.o 2>/dev/null", dir);
    FILE *p = popen(cmd, "r");
    int ok = p && fgets(out, (int)size, p) != NULL;
    if (p) pclose(p);
    if (ok) out[strcspn(out, "\n")] = 0;
    (void)size;
    return ok ? 0 : -1;
}

static char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    *n = b ? fread(b, 1, (size_t)len, f) : 0;
    if (b) b[*n] = 0;
    fclose(f);
    return b;
}
static void spill(const char *path, const void *b, size_t n)
{
    FILE *f = fopen(path, "wb");
    TH_CHECK(f && fwrite(b, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

int main(void)
{
    char msg[256];
    if (emit_llvm_probe(msg, sizeof msg) != KVQ_OK) {
        printf("SKIP cpu aot: %s\n", msg);
        return 0;
    }
    th_begin("cpu aot: kvqc is built next to the tests");
    TH_CHECK(th_tool_path("kvqc", kvqc, sizeof kvqc) == 0, "no executable %s (make builds it)", kvqc);
    TH_CHECK(mkdtemp(tmp) != NULL, "mkdtemp");
    if (!th_end()) return th_summary();
    kvq_spec *sp = tu_spec_file("specs/kivi2.kvq");
    const kvq_scheme *sch = sp ? kvq_spec_scheme_at(sp, 0) : NULL;
    if (!sch) return th_summary();
    char gen[PATH_MAX], sdir[PATH_MAX + 16], obj[PATH_MAX + 64], path[PATH_MAX + 64], cache[PATH_MAX];
    snprintf(gen, sizeof gen, "%s/generated", tmp);
    snprintf(sdir, sizeof sdir, "%s/kivi2", gen);
    snprintf(cache, sizeof cache, "%s/cache", tmp);
    setenv("KVQ_CACHE_DIR", cache, 1); /* an empty JIT cache: the first engine compiles */
    unsetenv("KVQ_GENERATED_DIR");

    th_begin("cpu aot: an engine without a prebuilt object compiles its kernels (the reference outputs)");
    {
        char origin[32], none[PATH_MAX + 16];
        snprintf(none, sizeof none, "%s/none", tmp);
        setenv("KVQ_GENERATED_DIR", none, 1);
        run_engine(sch, out_ref, origin, sizeof origin);
        unsetenv("KVQ_GENERATED_DIR");
        TH_CHECK(!strcmp(origin, "jit"), "kernels from %s, expected jit", origin);
    }
    th_end();

    th_begin("cpu aot: kvqc build --target cpu writes an object and cpu.json");
    int built = build(gen, NULL, NULL) == 0 && object_path(sdir, obj, sizeof obj) == 0;
    TH_CHECK(built, "no cpu-*.o in %s", sdir);
    size_t n = 0;
    snprintf(path, sizeof path, "%s/cpu.json", sdir);
    char *json = slurp(path, &n);
    TH_CHECK(json && strstr(json, "\"key\": \"") && strstr(json, "\"sha256\": \"") && strstr(json, "\"features\": ") &&
                 strstr(json, "kvq_tile_3: c0 2b-channel/2b-token-g32"),
             "cpu.json:\n%s", json ? json : "(missing)");
    free(json);
    th_end();
    if (!built) return th_summary();

    th_begin("cpu aot: an engine whose data directory holds the object loads it; outputs equal the JIT's");
    {
        /* $KVQ_SRCDIR: the data directory, as an installed library's share/kvq would be */
        static float out[STEPS][H * D];
        char origin[32];
        const char *old = getenv("KVQ_SRCDIR");
        char *saved = old ? strdup(old) : NULL;
        setenv("KVQ_SRCDIR", tmp, 1);
        run_engine(sch, out, origin, sizeof origin);
        if (saved) setenv("KVQ_SRCDIR", saved, 1);
        else unsetenv("KVQ_SRCDIR");
        free(saved);
        TH_CHECK(!strcmp(origin, "generated"), "kernels from %s, expected generated", origin);
        TH_CHECK(!memcmp(out, out_ref, sizeof out), "decode outputs differ from the JIT-built engine's");
    }
    check_engine(sch, gen, "generated", 1); /* and through $KVQ_GENERATED_DIR */
    th_end();

    size_t osize = 0;
    char *good = slurp(obj, &osize);
    th_begin("cpu aot: a corrupted object is a miss (compiled instead, same outputs)");
    {
        char *bad = malloc(osize);
        memcpy(bad, good, osize);
        bad[osize / 2] ^= 0x5a;
        spill(obj, bad, osize);
        free(bad);
        check_engine(sch, gen, "generated", 0);
    }
    th_end();
    th_begin("cpu aot: a truncated object is a miss");
    spill(obj, good, osize / 3);
    check_engine(sch, gen, "generated", 0);
    th_end();
    th_begin("cpu aot: an object LLVM rejects (its manifest line consistent) is a miss, no crash");
    {
        /* Not an object at all, with cpu.json's SHA-256 and size rewritten to match it. */
        static const char junk[] = "this is not an ELF object, whatever cpu.json says about it";
        char osha[65], jsha[65], osz[32], jsz[32];
        emit_cuda_sha256_hex(good, osize, osha);
        emit_cuda_sha256_hex(junk, sizeof junk, jsha);
        snprintf(osz, sizeof osz, "\"size\": %zu,", osize);
        snprintf(jsz, sizeof jsz, "\"size\": %zu,", sizeof junk);
        char *j = slurp(path, &n), *p = j ? strstr(j, osha) : NULL, *q = j ? strstr(j, osz) : NULL;
        const char *fixed_key_src = j ? j : "";
        TH_CHECK(p && q, "cpu.json has no line for the object");
        if (p && q) {
            memcpy(p, jsha, 64);
            char *fixed = malloc(n + 64);
            size_t pre = (size_t)(q - j);
            memcpy(fixed, j, pre);
            strcpy(fixed + pre, jsz);
            strcat(fixed, q + strlen(osz));
            spill(path, fixed, strlen(fixed));
            free(fixed);
            spill(obj, junk, sizeof junk);
            /* the store hands it over: the miss is LLVM's refusal, not the checksum's */
            char key[65] = "";
            const char *k = strstr(fixed_key_src, "\"key\": \"");
            if (k) snprintf(key, sizeof key, "%.64s", k + 8);
            size_t got = 0;
            void *b = cpu_aot_find(sdir, key, &got);
            TH_CHECK(b && got == sizeof junk, "cpu_aot_find did not return the rewritten object");
            kvq_free(b);
            check_engine(sch, gen, "generated", 0);
        }
        free(j);
    }
    th_end();
    free(good);

    th_begin("cpu aot: rebuilt, the object is used again");
    TH_CHECK(build(gen, NULL, NULL) == 0, "rebuild");
    check_engine(sch, gen, "generated", 1);
    th_end();

    th_begin("cpu aot: objects for other CPU features or another CPU are not loaded");
    {
        char other[PATH_MAX + 16], odir[PATH_MAX + 32], o2[PATH_MAX + 64];
        snprintf(other, sizeof other, "%s/other", tmp);
        snprintf(odir, sizeof odir, "%s/kivi2", other);
#if defined(__x86_64__)
        const char *feat = "+sse2,+sse4.1", *cpu = "x86-64";
#else
        const char *feat = "+neon", *cpu = "generic";
#endif
        TH_CHECK(build(other, "--cpu-features", feat) == 0 && object_path(odir, o2, sizeof o2) == 0,
                 "no object for --cpu-features %s", feat);
        check_engine(sch, other, "generated", 0);
        char cmd[PATH_MAX + 64];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", odir);
        TH_CHECK(system(cmd) == 0, "rm");
        TH_CHECK(build(other, "--cpu", cpu) == 0 && object_path(odir, o2, sizeof o2) == 0, "no object for --cpu %s",
                 cpu);
        check_engine(sch, other, "generated", 0);
    }
    th_end();

    kvq_spec_free(sp);
    unsetenv("KVQ_CACHE_DIR");
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0) printf("  (could not remove %s)\n", tmp);
    return th_summary();
}
