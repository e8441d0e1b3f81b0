/* NVRTC through dlopen: compile a generated translation unit to a cubin (and PTX) for one architecture, with
 * ptxas's resource report, through the on-disk cache. See cu.h. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "alloc.h"
#include "cu.h"
#include "emit_cuda.h"

typedef int nvrtc_res;
typedef struct nvrtc_prog_ *nvrtc_prog;

static struct {
    int loaded;
    char version[16];
    nvrtc_res (*create)(nvrtc_prog *, const char *, const char *, int, const char *const *, const char *const *);
    nvrtc_res (*compile)(nvrtc_prog, int, const char *const *);
    nvrtc_res (*log_size)(nvrtc_prog, size_t *);
    nvrtc_res (*log)(nvrtc_prog, char *);
    nvrtc_res (*cubin_size)(nvrtc_prog, size_t *);
    nvrtc_res (*cubin)(nvrtc_prog, char *);
    nvrtc_res (*ptx_size)(nvrtc_prog, size_t *);
    nvrtc_res (*ptx)(nvrtc_prog, char *);
    nvrtc_res (*destroy)(nvrtc_prog *);
    nvrtc_res (*ver)(int *, int *);
    const char *(*error)(nvrtc_res);
} nv;

kvq_status cu_nvrtc_load(char *msg, size_t n)
{
    if (nv.loaded) return KVQ_OK;
    const char *env = getenv("KVQ_NVRTC");
    const char *const names[] = {env && *env ? env : "libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12",
                                 "/usr/local/cuda/lib64/libnvrtc.so"};
    void *h = NULL;
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !h; i++) h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(msg, n, "cuda: NVRTC unavailable: libnvrtc not found (%s); set KVQ_NVRTC to its path",
                 e ? e : "no error text");
        return KVQ_ERR_UNAVAILABLE;
    }
    struct {
        void *slot;
        const char *name;
    } syms[] = {{&nv.create, "nvrtcCreateProgram"},       {&nv.compile, "nvrtcCompileProgram"},
                {&nv.log_size, "nvrtcGetProgramLogSize"}, {&nv.log, "nvrtcGetProgramLog"},
                {&nv.cubin_size, "nvrtcGetCUBINSize"},    {&nv.cubin, "nvrtcGetCUBIN"},
                {&nv.ptx_size, "nvrtcGetPTXSize"},        {&nv.ptx, "nvrtcGetPTX"},
                {&nv.destroy, "nvrtcDestroyProgram"},     {&nv.ver, "nvrtcVersion"},
                {&nv.error, "nvrtcGetErrorString"}};
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = dlsym(h, syms[i].name);
        if (!f) {
            snprintf(msg, n, "cuda: NVRTC unavailable: libnvrtc lacks %s", syms[i].name);
            dlclose(h);
            return KVQ_ERR_UNAVAILABLE;
        }
        memcpy(syms[i].slot, &f, sizeof f); /* data pointer -> function pointer, as dlsym requires */
    }
    int major = 0, minor = 0;
    nv.ver(&major, &minor);
    snprintf(nv.version, sizeof nv.version, "%d.%d", major, minor);
    nv.loaded = 1; /* the handle stays open for the life of the process */
    return KVQ_OK;
}

const char *cu_nvrtc_version(void) { return nv.loaded ? nv.version : ""; }

void cu_compiled_free(cu_compiled *c)
{
    kvq_free(c->cubin);
    kvq_free(c->ptx);
    kvq_free(c->log);
    kvq_free(c->res);
    memset(c, 0, sizeof *c);
}

/* ---- resources ---- */

static int parse_int_before(const char *line, const char *suffix, int *out)
{
    const char *p = strstr(line, suffix);
    if (!p) return 0;
    const char *q = p;
    while (q > line && q[-1] == ' ') q--;
    while (q > line && q[-1] >= '0' && q[-1] <= '9') q--;
    *out = atoi(q);
    return 1;
}

int cu_parse_resources(const char *log, cu_kernel_res **out)
{
    *out = NULL;
    int n = 0, cap = 0;
    cu_kernel_res *r = NULL, *cur = NULL;
    const char *line = log ? log : "";
    while (*line) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        char buf[512];
        snprintf(buf, sizeof buf, "%.*s", (int)(len < sizeof buf ? len : sizeof buf - 1), line);
        const char *e = strstr(buf, "Compiling entry function '");
        if (e) {
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                cu_kernel_res *t = kvq_realloc(r, (size_t)cap * sizeof *t);
                if (!t) {
                    kvq_free(r);
                    return -1;
                }
                r = t;
            }
            cur = &r[n++];
            memset(cur, 0, sizeof *cur);
            e += strlen("Compiling entry function '");
            const char *q = strchr(e, '\'');
            snprintf(cur->name, sizeof cur->name, "%.*s", (int)(q ? q - e : 0), e);
            const char *a = q ? strstr(q, "for '") : NULL;
            if (a) {
                a += 5;
                const char *z = strchr(a, '\'');
                snprintf(cur->arch, sizeof cur->arch, "%.*s", (int)(z ? z - a : 0), a);
            }
        } else if (cur) {
            parse_int_before(buf, "bytes stack frame", &cur->stack);
            parse_int_before(buf, "bytes spill stores", &cur->spill_stores);
            parse_int_before(buf, "bytes spill loads", &cur->spill_loads);
            parse_int_before(buf, "registers", &cur->regs);
            parse_int_before(buf, "bytes smem", &cur->smem);
            parse_int_before(buf, "bytes lmem", &cur->lmem);
            parse_int_before(buf, "barriers", &cur->barriers);
        }
        line += len + (nl ? 1 : 0);
    }
    *out = r;
    return n;
}

/* ---- compile ---- */

#define N_OPTS 5
/* The options; the count used (4, or 5 with line info). */
static int options(const char *arch, int lineinfo, char opt_arch[64], const char *opts[N_OPTS])
{
    snprintf(opt_arch, 64, "--gpu-architecture=%s", arch);
    opts[0] = opt_arch;
    opts[1] = "--std=c++14";
    opts[2] = "--ptxas-options=-v";  /* the resource lines the report and the tests read */
    opts[3] = "--diag-suppress=177"; /* templates define helpers a given plan does not use */
    /* kvqc build's cost model maps SASS to source lines; -lineinfo adds the tables, not code (the cost model
     * checks that the instructions equal the shipped cubin's) */
    opts[4] = "--generate-line-info";
    return lineinfo ? 5 : 4;
}

/* The failure text: options, NVRTC log, numbered source. */
static char *failure_text(const char *src, const char *const *opts, int nopt, const char *log)
{
    emit_buf b = {0};
    emit_buf_printf(&b, "NVRTC %s compile failed\noptions:", cu_nvrtc_version());
    for (int i = 0; i < nopt; i++) emit_buf_printf(&b, " %s", opts[i]);
    emit_buf_printf(&b, "\n---- log ----\n%s\n---- source ----\n", log ? log : "");
    int line = 1;
    const char *p = src;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        emit_buf_printf(&b, "%5d  %.*s\n", line++, (int)len, p);
        p += len + (nl ? 1 : 0);
    }
    if (b.failed) {
        emit_buf_free(&b);
        return NULL;
    }
    return b.s;
}

/* The entry `key` from the cache into *out: 1 a hit, 0 a miss, -1 out of memory. */
static int cached(const char *key, cu_compiled *out)
{
    void *sec[3];
    size_t sz[3];
    if (!kvq_cache_get(key, "cubin", sec, sz, 3)) return 0;
    out->cubin = sec[0], out->cubin_size = sz[0];
    out->ptx = sec[1], out->ptx_size = sz[1];
    out->log = sec[2];
    out->from_cache = 1;
    out->n_res = cu_parse_resources(out->log, &out->res);
    if (out->n_res < 0) {
        cu_compiled_free(out);
        return -1;
    }
    return 1;
}

/* $KVQ_NVRTC_HELPER (tests/run.sh sets it to the plain build's tests/nvrtc-helper): a program built without the
 * sanitizers that compiles one unit into the cache. In a process under AddressSanitizer every one of NVRTC's
 * allocations goes through ASan's allocator, which makes a compile about 1.8 times as long (docs/testing.md, "Test
 * time"); the helper compiles it at full speed and this process reads the entry back. Returns 1 when the helper
 * says it compiled (the caller still checks the cache: a helper from another build may key differently, and then
 * the unit is compiled here, as without a helper). */
static int helper_compile(const char *helper, const char *src, const char *arch, int lineinfo, const char *key)
{
    char path[4300], base[4200];
    kvq_cache_path(key, "cu", base, sizeof base);
    snprintf(path, sizeof path, "%s.tmp.%ld", base, (long)getpid());
    FILE *f = fopen(path, "w");
    if (!f) return 0;
    int ok = fputs(src, f) >= 0;
    if (fclose(f) != 0 || !ok) {
        unlink(path);
        return 0;
    }
    /* KVQ_NVRTC_CHILD=1: the helper neither locks (this process holds the key's lock) nor calls a helper itself */
    char *argv[] = {(char *)helper, (char *)arch, lineinfo ? "1" : "0", path, NULL};
    ok = kvq_cache_run_helper(argv, "KVQ_NVRTC_CHILD=1");
    unlink(path);
    return ok;
}

/* Compiles in this process; stores the result in the cache when use_cache. */
static kvq_status compile_here(const char *src, const char *arch, const char *const *opts, int nopts, const char *key,
                               int use_cache, cu_compiled *out, char **diag, char *msg, size_t n)
{
    kvq_status st;
    nvrtc_prog prog = NULL;
    nvrtc_res r = nv.create(&prog, src, "kernels.cu", 0, NULL, NULL);
    if (r != 0) {
        snprintf(msg, n, "cuda: nvrtcCreateProgram: %s", nv.error(r));
        return r == 1 ? KVQ_ERR_NOMEM : KVQ_ERR_INTERNAL;
    }
    r = nv.compile(prog, nopts, opts);
    size_t log_size = 0;
    nv.log_size(prog, &log_size);
    char *log = kvq_malloc(log_size + 1);
    if (!log) {
        nv.destroy(&prog);
        snprintf(msg, n, "cuda: out of memory");
        return KVQ_ERR_NOMEM;
    }
    log[0] = 0;
    if (log_size) nv.log(prog, log);
    log[log_size] = 0;
    if (r != 0) {
        char *text = failure_text(src, opts, nopts, log);
        char path[4200] = "";
        if (text && kvq_cache_dir()[0]) {
            char fkey[80];
            snprintf(fkey, sizeof fkey, "failed-%s", key);
            kvq_cache_path(fkey, "txt", path, sizeof path);
            FILE *f = fopen(path, "w");
            if (!f || fputs(text, f) < 0) path[0] = 0;
            if (f) fclose(f);
        }
        /* The first error line of the log, then where the whole story is. ptxas refuses more than 48 KiB of static
         * shared memory without an error line (NVRTC 13): its resource lines say which kernel. */
        const char *first = strstr(log, "error");
        char why[256] = "";
        cu_kernel_res *res = NULL;
        int nres = first ? 0 : cu_parse_resources(log, &res);
        for (int i = 0; i < nres && !why[0]; i++)
            if (res[i].smem > 48 * 1024)
                snprintf(why, sizeof why, "kernel %s uses %d bytes of static shared memory, more than 49152 (ptxas)",
                         res[i].name, res[i].smem);
        kvq_free(res);
        snprintf(msg, n, "cuda: NVRTC failed to compile the kernels for %s (%s): %.200s%s%s", arch, nv.error(r),
                 first ? first : why[0] ? why : log, path[0] ? "; source, options and log in " : "", path);
        if (diag)
            *diag = text;
        else
            kvq_free(text);
        kvq_free(log);
        nv.destroy(&prog);
        return KVQ_ERR_INTERNAL;
    }
    out->log = log;
    st = KVQ_OK;
    if (nv.cubin_size(prog, &out->cubin_size) != 0 || nv.ptx_size(prog, &out->ptx_size) != 0) {
        snprintf(msg, n, "cuda: NVRTC produced no cubin for %s", arch);
        st = KVQ_ERR_INTERNAL;
    } else {
        out->cubin = kvq_malloc(out->cubin_size ? out->cubin_size : 1);
        out->ptx = kvq_malloc(out->ptx_size + 1);
        if (!out->cubin || !out->ptx) {
            snprintf(msg, n, "cuda: out of memory");
            st = KVQ_ERR_NOMEM;
        } else {
            nv.cubin(prog, (char *)out->cubin);
            nv.ptx(prog, out->ptx);
            out->ptx[out->ptx_size] = 0;
            if (out->ptx_size && out->ptx[out->ptx_size - 1] == 0) out->ptx_size--; /* drop NVRTC's NUL */
        }
    }
    nv.destroy(&prog);
    if (st == KVQ_OK) {
        out->n_res = cu_parse_resources(out->log, &out->res);
        if (out->n_res < 0) {
            snprintf(msg, n, "cuda: out of memory");
            st = KVQ_ERR_NOMEM;
        }
    }
    if (st != KVQ_OK) {
        cu_compiled_free(out);
        return st;
    }
    if (use_cache) {
        kvq_cache_section sec[3] = {{out->cubin, out->cubin_size}, {out->ptx, out->ptx_size}, {out->log, strlen(out->log)}};
        kvq_cache_put(key, "cubin", sec, 3);
    }
    return KVQ_OK;
}


static kvq_status compile(const char *src, const char *arch, int lineinfo, int use_cache, cu_compiled *out,
                          char **diag, char *msg, size_t n)
{
    memset(out, 0, sizeof *out);
    if (diag) *diag = NULL;
    kvq_status st = cu_nvrtc_load(msg, n);
    if (st != KVQ_OK) return st;
    char opt_arch[64];
    const char *opts[N_OPTS];
    const int nopts = options(arch, lineinfo, opt_arch, opts);

    /* Cache key (DESIGN §7): source, options, compiler version, target, kvq version. */
    emit_buf kb = {0};
    emit_buf_printf(&kb, "%s\n%s\n%s\n", EMIT_CUDA_KVQ_VERSION, nv.version, arch);
    for (int i = 0; i < nopts; i++) emit_buf_printf(&kb, "%s\n", opts[i]);
    emit_buf_put(&kb, src, strlen(src));
    if (kb.failed) {
        emit_buf_free(&kb);
        snprintf(msg, n, "cuda: out of memory");
        return KVQ_ERR_NOMEM;
    }
    char key[65];
    emit_cuda_sha256_hex(kb.s, kb.len, key);
    emit_buf_free(&kb);
    if (!use_cache) return compile_here(src, arch, opts, nopts, key, 0, out, diag, msg, n);

    int hit = cached(key, out);
    if (hit == 0) {
        /* One compile of a key at a time across processes: a second process waits for the first's entry. */
        const int child = getenv("KVQ_NVRTC_CHILD") != NULL;
        char lock[80];
        snprintf(lock, sizeof lock, "nvrtc-%s", key);
        const int lk = child ? -1 : kvq_cache_lock(lock);
        if (lk >= 0) hit = cached(key, out);
        const char *helper = getenv("KVQ_NVRTC_HELPER");
        if (hit == 0 && !child && helper && *helper && helper_compile(helper, src, arch, lineinfo, key) &&
            (hit = cached(key, out)) > 0)
            out->from_cache = 0; /* compiled for this call */
        if (hit == 0) {
            st = compile_here(src, arch, opts, nopts, key, 1, out, diag, msg, n);
            kvq_cache_unlock(lock, lk);
            return st;
        }
        kvq_cache_unlock(lock, lk);
    }
    if (hit < 0) {
        snprintf(msg, n, "cuda: out of memory");
        return KVQ_ERR_NOMEM;
    }
    return KVQ_OK;
}

kvq_status cu_nvrtc_compile(const char *src, const char *arch, int use_cache, cu_compiled *out, char **diag, char *msg,
                            size_t n)
{
    return compile(src, arch, 0, use_cache, out, diag, msg, n);
}

kvq_status cu_nvrtc_compile_lineinfo(const char *src, const char *arch, int use_cache, cu_compiled *out, char **diag,
                                     char *msg, size_t n)
{
    return compile(src, arch, 1, use_cache, out, diag, msg, n);
}
