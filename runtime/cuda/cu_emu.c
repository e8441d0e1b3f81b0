/* The emulator device: the generated translation unit compiled by the host C++ compiler against
 * tests/emu/emu_cuda.h (via kvq_intrin.cuh) into a shared object together with the emulator's runtime, loaded
 * with dlopen and launched through its emu_launch (docs/emulator.md). Objects are cached in the JIT cache like
 * cubins, keyed by the source, the compiler command and the emulator's own sources. When libkvq is built with
 * AddressSanitizer the kernels are too, so the tests check the kernels' memory accesses as well, unless
 * $KVQ_EMU_SANITIZE=0: then the kernels and the emulator's runtime are compiled without the sanitizers (3 to 5
 * times faster under the emulator), or =address: with ASan only (about 2 times faster), while libkvq itself stays
 * instrumented (test_cuda_replay, test_cuda_device; docs/testing.md). */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "cu_dev.h"
#include "emit_cuda.h"
#include "emu/emu.h"
#include "plan.h"

extern char **environ;

#if defined(__SANITIZE_ADDRESS__)
#define EMU_SAN " -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
#define EMU_ASAN " -fsanitize=address -fno-omit-frame-pointer"
#else
#define EMU_SAN ""
#define EMU_ASAN ""
#endif

static const char *const emu_rt_files[] = {"exec.c", "warp.c", "cp_async.c", "fiber.c", "profile.c"};
static const char *const emu_hdr_files[] = {"emu.h",   "emu_abi.h",  "emu_internal.h",
                                            "fiber.h", "emu_cuda.h", "emu_half.h"};
#define N_RT 5
#define N_HDR 6

/* A kernel's attributes as the driver holds them: ptxas's registers and static shared memory, and the dynamic
 * shared memory maximum cuFuncSetAttribute set. */
typedef struct {
    char name[64];
    struct emu_func_attrs a;
} emu_fn;

typedef struct {
    void *so;
    emu_status (*launch)(const struct emu_kernel *, emu_dim3, emu_dim3, size_t, const void *, size_t,
                         const struct emu_options *, struct emu_error *);
    void (*release)(void);
    emu_fn *fns; /* from NVRTC's resource report for the emulated arch; NULL when NVRTC is not available */
    int n_fns, cap_fns, resources;
    struct emu_sym {
        char name[64];
        const struct emu_kernel *k;
    } *syms; /* kernels looked up so far (cuModuleGetFunction once per name, not per launch) */
    int n_syms, cap_syms;
} emu_mod;

typedef struct {
    char cc[256], cxx[256], opt[32];
    const char *san; /* EMU_SAN; "" with $KVQ_EMU_SANITIZE=0, EMU_ASAN with =address */
    char emu_dir[4096];
    char target[16]; /* the GPU emulated: its limits, and the arch NVRTC reports resources for */
    unsigned smem_optin;
    int resources; /* read ptxas's figures for the launch checks (0 with $KVQ_EMU_RESOURCES=0) */
    uintptr_t ctx; /* this device's context id (never reused) */
} emu_dev;

/* ---- contexts: the emulated device is current on one thread at a time per thread, as a CUDA context is ---- */

static __thread uintptr_t emu_current; /* the calling thread's current context (0: none) */
static uintptr_t emu_ctx_ids;          /* ids handed out so far (atomic) */

static int no_context(const cu_dev *d, const char *what, char *msg, size_t n)
{
    if (emu_current == ((const emu_dev *)d->impl)->ctx) return 0;
    snprintf(msg, n, "emu: %s: CUDA_ERROR_INVALID_CONTEXT (201): the device's context is not current on this thread",
             what);
    return 1;
}

static void emu_enter(cu_dev *d, cu_ctx_scope *s)
{
    uintptr_t mine = ((const emu_dev *)d->impl)->ctx;
    s->prev = (void *)emu_current;
    s->changed = emu_current != mine;
    emu_current = mine;
}

static void emu_leave(cu_dev *d, const cu_ctx_scope *s)
{
    (void)d;
    emu_current = (uintptr_t)s->prev;
}

/* ---- memory: host memory, 256-byte aligned as cuMemAlloc's ---- */

static kvq_status emu_alloc(cu_dev *d, size_t bytes, uint64_t *addr, char *msg, size_t n)
{
    if (no_context(d, "cuMemAlloc", msg, n)) return KVQ_ERR_INTERNAL;
    unsigned char *raw = kvq_calloc(1, bytes + 256 + 8);
    if (!raw) {
        snprintf(msg, n, "emu: out of memory (%zu bytes)", bytes);
        return KVQ_ERR_NOMEM;
    }
    uintptr_t a = ((uintptr_t)raw + 8 + 255) & ~(uintptr_t)255;
    memcpy((void *)(a - 8), &raw, sizeof raw);
    *addr = (uint64_t)a;
    return KVQ_OK;
}

static void emu_free(cu_dev *d, uint64_t addr)
{
    char msg[160];
    if (no_context(d, "cuMemFree", msg, sizeof msg)) return; /* the driver's cuMemFree fails: the memory stays */
    void *raw;
    memcpy(&raw, (void *)(uintptr_t)(addr - 8), sizeof raw);
    kvq_free(raw);
}

static kvq_status emu_alloc_host(cu_dev *d, size_t bytes, void **host, uint64_t *addr, char *msg, size_t n)
{
    kvq_status st = emu_alloc(d, bytes, addr, msg, n);
    *host = st == KVQ_OK ? (void *)(uintptr_t)*addr : NULL;
    return st;
}

static void emu_free_host(cu_dev *d, void *host) { emu_free(d, (uint64_t)(uintptr_t)host); }

/* The stream's work runs when it is queued (the emulator is eager), so a copy, a memset and a sync need no
 * ordering of their own; they check the context as the driver's calls do. */
static kvq_status emu_h2d(cu_dev *d, uint64_t dst, const void *src, size_t n, char *msg, size_t ms)
{
    if (no_context(d, "cuMemcpyHtoDAsync", msg, ms)) return KVQ_ERR_INTERNAL;
    memcpy((void *)(uintptr_t)dst, src, n);
    return KVQ_OK;
}

static kvq_status emu_d2h(cu_dev *d, void *dst, uint64_t src, size_t n, char *msg, size_t ms)
{
    if (no_context(d, "cuMemcpyDtoHAsync", msg, ms)) return KVQ_ERR_INTERNAL;
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return KVQ_OK;
}

static kvq_status emu_memset(cu_dev *d, uint64_t dst, int byte, size_t n, char *msg, size_t ms)
{
    if (no_context(d, "cuMemsetD8Async", msg, ms)) return KVQ_ERR_INTERNAL;
    memset((void *)(uintptr_t)dst, byte, n);
    return KVQ_OK;
}

static kvq_status emu_sync(cu_dev *d, char *msg, size_t ms)
{
    return no_context(d, "cuStreamSynchronize", msg, ms) ? KVQ_ERR_INTERNAL : KVQ_OK;
}

/* Events: the emulator runs every call when it is made, so a recorded event has always completed. */
static kvq_status emu_event_create(cu_dev *d, void **ev, char *msg, size_t ms)
{
    if (no_context(d, "cuEventCreate", msg, ms)) return KVQ_ERR_INTERNAL;
    *ev = kvq_malloc(1);
    if (!*ev) {
        snprintf(msg, ms, "emu: out of memory");
        return KVQ_ERR_NOMEM;
    }
    return KVQ_OK;
}
static void emu_event_destroy(cu_dev *d, void *ev)
{
    (void)d;
    kvq_free(ev);
}
static kvq_status emu_event_record(cu_dev *d, void *ev, char *msg, size_t ms)
{
    (void)ev;
    return no_context(d, "cuEventRecord", msg, ms) ? KVQ_ERR_INTERNAL : KVQ_OK;
}
static kvq_status emu_event_wait(cu_dev *d, void *ev, char *msg, size_t ms)
{
    (void)ev;
    return no_context(d, "cuEventSynchronize", msg, ms) ? KVQ_ERR_INTERNAL : KVQ_OK;
}

/* ---- building ---- */

/* Runs argv with stdout/stderr to `log`; returns the exit status (-1: could not start). */
static int run_cmd(char *const argv[], const char *log)
{
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return -1;
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Splits a command line (compiler name and flags) into argv entries appended at *argc. */
static void split_args(char *s, char **argv, int *argc, int max)
{
    for (char *t = strtok(s, " "); t && *argc < max - 1; t = strtok(NULL, " ")) argv[(*argc)++] = t;
}

static int file_exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0;
}

static void log_head(const char *log, char *out, size_t n)
{
    FILE *f = fopen(log, "r");
    size_t k = f ? fread(out, 1, n - 1, f) : 0;
    out[k] = 0;
    if (f) fclose(f);
}

static kvq_status build_runtime_objs(emu_dev *e, const char *rtdir, char objs[N_RT][4300], char *msg, size_t n);

/* The emulator runtime objects, compiled once per (sources, flags) into <cache>/emu-rt-<hash>/. */
static kvq_status build_runtime(emu_dev *e, const char *dir, char objs[N_RT][4300], char *msg, size_t n)
{
    emit_buf kb = {0};
    emit_buf_printf(&kb, "%s|%s|%s\n", e->cc, e->opt, e->san);
    for (int i = 0; i < N_RT + N_HDR; i++) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", e->emu_dir, i < N_RT ? emu_rt_files[i] : emu_hdr_files[i - N_RT]);
        FILE *f = fopen(path, "rb");
        if (!f) {
            emit_buf_free(&kb);
            snprintf(msg, n, "emu: unavailable: emulator source %s missing (set KVQ_SRCDIR)", path);
            return KVQ_ERR_UNAVAILABLE;
        }
        char buf[8192];
        size_t k;
        while ((k = fread(buf, 1, sizeof buf, f)) > 0) emit_buf_put(&kb, buf, k);
        fclose(f);
    }
    if (kb.failed) {
        emit_buf_free(&kb);
        return KVQ_ERR_NOMEM;
    }
    char key[65];
    emit_cuda_sha256_hex(kb.s, kb.len, key);
    emit_buf_free(&kb);
    char rtdir[4200];
    snprintf(rtdir, sizeof rtdir, "%.4096s/emu-rt-%.16s", dir, key);
    int have = 1;
    for (int i = 0; i < N_RT; i++) {
        snprintf(objs[i], 4300, "%.4150s/%.16s.o", rtdir, emu_rt_files[i]);
        have &= file_exists(objs[i]);
    }
    if (have) return KVQ_OK;
    char lock[80];
    snprintf(lock, sizeof lock, "emu-rt-%.16s", key);
    const int lk = kvq_cache_lock(lock);
    kvq_status st = build_runtime_objs(e, rtdir, objs, msg, n);
    kvq_cache_unlock(lock, lk);
    return st;
}

/* Compiles the runtime objects missing from rtdir (another process may have made them while this one waited). */
static kvq_status build_runtime_objs(emu_dev *e, const char *rtdir, char objs[N_RT][4300], char *msg, size_t n)
{
    mkdir(rtdir, 0755);
    for (int i = 0; i < N_RT; i++) {
        if (file_exists(objs[i])) continue;
        char cmd[1024], src[4200], tmp[4400], log[4500];
        snprintf(cmd, sizeof cmd, "%s -std=c11 -D_GNU_SOURCE %s -g0 -fPIC%s", e->cc, e->opt, e->san);
        snprintf(src, sizeof src, "%.4096s/%.16s", e->emu_dir, emu_rt_files[i]);
        snprintf(tmp, sizeof tmp, "%.4300s.tmp.%ld", objs[i], (long)getpid());
        snprintf(log, sizeof log, "%s.log", tmp);
        char inc[4200];
        snprintf(inc, sizeof inc, "-I%.4096s", e->emu_dir);
        char *argv[64];
        int argc = 0;
        split_args(cmd, argv, &argc, 64);
        argv[argc++] = inc;
        argv[argc++] = "-c";
        argv[argc++] = src;
        argv[argc++] = "-o";
        argv[argc++] = tmp;
        argv[argc] = NULL;
        int rc = run_cmd(argv, log);
        if (rc != 0) {
            char head[600];
            log_head(log, head, sizeof head);
            snprintf(msg, n, "emu: compiling the emulator runtime (%s) failed: %s", src,
                     rc < 0 ? "no C compiler" : head);
            unlink(tmp);
            unlink(log);
            return rc < 0 ? KVQ_ERR_UNAVAILABLE : KVQ_ERR_INTERNAL;
        }
        unlink(log);
        if (rename(tmp, objs[i]) != 0) {
            snprintf(msg, n, "emu: cannot write %s", objs[i]);
            unlink(tmp);
            return KVQ_ERR_IO;
        }
    }
    return KVQ_OK;
}

/* The kernels' resources as ptxas reports them for the emulated GPU (NVRTC, through the JIT cache): a source the
 * GPU's compiler refuses (more than 48 KiB of static shared memory, say) is refused here too, with its message.
 * Without NVRTC, or with $KVQ_EMU_RESOURCES=0, the module has no figures and launches are checked against the
 * grid, block and dynamic shared memory limits only (docs/emulator.md), and the occupancy counts no registers. The
 * variable is for test programs that test their kernels' results or the host side, not these checks, where
 * test_cuda_nvrtc compiles the specs and test_cuda_emu loads them with the figures (tests/test-times `res=0`): the
 * NVRTC compile of a unit for its figures costs more than its emulated module (docs/testing.md, "Test time"). */
static kvq_status emu_resources(emu_dev *e, const char *src, emu_mod *em, char *msg, size_t n)
{
    char why[512];
    if (!e->resources || cu_nvrtc_load(why, sizeof why) != KVQ_OK) return KVQ_OK;
    cu_compiled c;
    memset(&c, 0, sizeof c);
    char cm[1024] = "";
    kvq_status st = cu_nvrtc_compile(src, e->target, 1, &c, NULL, cm, sizeof cm);
    if (st != KVQ_OK) {
        snprintf(msg, n, "emu: the kernels do not compile for %s, the emulated GPU: %s", e->target, cm);
        return st;
    }
    em->fns = c.n_res > 0 ? kvq_calloc((size_t)c.n_res, sizeof *em->fns) : NULL;
    if (c.n_res > 0 && !em->fns) {
        cu_compiled_free(&c);
        return KVQ_ERR_NOMEM;
    }
    for (int i = 0; i < c.n_res; i++) {
        emu_fn *f = &em->fns[em->n_fns++];
        snprintf(f->name, sizeof f->name, "%s", c.res[i].name);
        f->a.regs = (unsigned)c.res[i].regs;
        f->a.static_smem = (unsigned)c.res[i].smem;
    }
    em->cap_fns = c.n_res;
    em->resources = 1;
    cu_compiled_free(&c);
    return KVQ_OK;
}

static emu_fn *find_fn(emu_mod *em, const char *kernel)
{
    for (int i = 0; i < em->n_fns; i++)
        if (!strcmp(em->fns[i].name, kernel)) return &em->fns[i];
    return NULL;
}

static kvq_status emu_load(cu_dev *d, const char *src, const char *scheme, cu_module **out, char *msg, size_t n)
{
    (void)scheme;
    emu_dev *e = d->impl;
    *out = NULL;
    if (no_context(d, "cuModuleLoadData", msg, n)) return KVQ_ERR_INTERNAL;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", kvq_cache_dir());
    int tmpdir = 0;
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/kvq-emu-XXXXXX");
        if (!mkdtemp(dir)) {
            snprintf(msg, n, "emu: no cache directory and no temporary directory");
            return KVQ_ERR_IO;
        }
        tmpdir = 1;
    }
    char objs[N_RT][4300];
    kvq_status st = build_runtime(e, dir, objs, msg, n);
    if (st != KVQ_OK) return st;

    char cmd[1024];
    /* -ffp-contract=off: the policy kernels reproduce the host's separately rounded products (kvq_dmul) */
    /* $KVQ_EMU_PROFILE (kvqc build's cost model): unoptimised, with line tables, every call and basic block
     * reported to tests/emu/profile.c, which writes the warp counts to that file when the module is unloaded */
    const char *prof = getenv("KVQ_EMU_PROFILE");
    snprintf(cmd, sizeof cmd, "%s -std=c++14 %s -fPIC -shared -fno-exceptions -fno-rtti -ffp-contract=off%s", e->cxx,
             prof && *prof ? "-O0 -g -finstrument-functions -fsanitize-coverage=trace-pc" : e->opt, e->san);
    if (!(prof && *prof)) strncat(cmd, " -g0", sizeof cmd - strlen(cmd) - 1);
    emit_buf kb = {0};
    emit_buf_printf(&kb, "%s\n%s\n%s\n%s\n", EMIT_CUDA_KVQ_VERSION, cmd, objs[0], e->emu_dir);
    emit_buf_put(&kb, src, strlen(src));
    if (kb.failed) {
        emit_buf_free(&kb);
        return KVQ_ERR_NOMEM;
    }
    char key[65];
    emit_cuda_sha256_hex(kb.s, kb.len, key);
    emit_buf_free(&kb);
    char so[4200], cu[4200];
    snprintf(so, sizeof so, "%.4096s/%s.emu.so", dir, key);
    snprintf(cu, sizeof cu, "%.4096s/%s.emu.cu", dir, key);
    int origin_cache = file_exists(so);
    /* one compile of a module at a time across processes (programs sharing make test's cache): a second waits */
    char lock[80];
    snprintf(lock, sizeof lock, "emu-%s", key);
    const int lk = origin_cache || tmpdir ? -1 : kvq_cache_lock(lock);
    if (lk >= 0) origin_cache = file_exists(so);
    if (!origin_cache) {
        FILE *f = fopen(cu, "w");
        if (!f || fputs(src, f) < 0) {
            if (f) fclose(f);
            snprintf(msg, n, "emu: cannot write %s", cu);
            kvq_cache_unlock(lock, lk);
            return KVQ_ERR_IO;
        }
        fclose(f);
        char tmp[4300], log[4200], inc1[4200], inc2[4200];
        snprintf(tmp, sizeof tmp, "%.4200s.tmp.%ld", so, (long)getpid());
        snprintf(log, sizeof log, "%.4096s/%s.emu.log", dir, key);
        snprintf(inc1, sizeof inc1, "-I%.4096s", e->emu_dir);
        snprintf(inc2, sizeof inc2, "-I%.4096s/templates", kvq_data_dir());
        char *argv[64];
        int argc = 0;
        split_args(cmd, argv, &argc, 48);
        argv[argc++] = inc1;
        argv[argc++] = inc2;
        argv[argc++] = "-x";
        argv[argc++] = "c++";
        argv[argc++] = cu;
        argv[argc++] = "-x";
        argv[argc++] = "none";
        for (int i = 0; i < N_RT; i++) argv[argc++] = objs[i];
        argv[argc++] = "-o";
        argv[argc++] = tmp;
        argv[argc] = NULL;
        int rc = run_cmd(argv, log);
        if (rc != 0 || rename(tmp, so) != 0) {
            char head[700];
            log_head(log, head, sizeof head);
            snprintf(msg, n, "emu: compiling the kernels failed (source %s, log %s): %s", cu, log,
                     rc < 0 ? "no C++ compiler" : head);
            unlink(tmp);
            kvq_cache_unlock(lock, lk);
            return rc < 0 ? KVQ_ERR_UNAVAILABLE : KVQ_ERR_INTERNAL;
        }
        unlink(log);
        /* kept on failure, for the message, and for a profile (the source its line numbers refer to) */
        if (!tmpdir && !(prof && *prof)) unlink(cu);
    }
    kvq_cache_unlock(lock, lk);
    void *h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
    if (tmpdir) {
        unlink(so);
        unlink(cu);
        for (int i = 0; i < N_RT; i++) unlink(objs[i]);
    }
    if (!h) {
        const char *er = dlerror();
        snprintf(msg, n, "emu: cannot load %s: %s", so, er ? er : "?");
        return KVQ_ERR_INTERNAL;
    }
    cu_module *m = kvq_calloc(1, sizeof *m);
    emu_mod *em = kvq_calloc(1, sizeof *em);
    if (!m || !em) {
        kvq_free(m);
        kvq_free(em);
        dlclose(h);
        return KVQ_ERR_NOMEM;
    }
    em->so = h;
    void *f1 = dlsym(h, "emu_launch"), *f2 = dlsym(h, "emu_release");
    memcpy(&em->launch, &f1, sizeof f1);
    memcpy(&em->release, &f2, sizeof f2);
    kvq_status rs = KVQ_ERR_INTERNAL;
    if (!em->launch || !em->release)
        snprintf(msg, n, "emu: %s lacks the emulator runtime", so);
    else
        rs = emu_resources(e, src, em, msg, n);
    if (rs != KVQ_OK) {
        dlclose(h);
        kvq_free(em->fns);
        kvq_free(m);
        kvq_free(em);
        return rs;
    }
    m->dev = d;
    m->impl = em;
    snprintf(m->origin, sizeof m->origin, "%s", origin_cache ? "cache" : "jit");
    *out = m;
    return KVQ_OK;
}

static void emu_module_free(cu_module *m)
{
    char msg[160];
    if (no_context(m->dev, "cuModuleUnload", msg, sizeof msg)) return; /* the driver's unload fails: it stays */
    emu_mod *em = m->impl;
    em->release();
    dlclose(em->so);
    kvq_free(em->fns);
    kvq_free(em->syms);
    kvq_free(em);
    kvq_free(m);
}

static kvq_status emu_max_dyn_smem(cu_dev *d, cu_module *m, const char *kernel, unsigned bytes, char *msg, size_t n)
{
    if (no_context(d, "cuFuncSetAttribute", msg, n)) return KVQ_ERR_INTERNAL;
    emu_dev *e = d->impl;
    emu_mod *em = m->impl;
    char sym[96];
    snprintf(sym, sizeof sym, "%s__emu", kernel);
    if (!dlsym(em->so, sym)) {
        snprintf(msg, n, "emu: cuFuncSetAttribute: no kernel %s in the module (CUDA_ERROR_NOT_FOUND)", kernel);
        return KVQ_ERR_INTERNAL;
    }
    emu_fn *f = find_fn(em, kernel);
    if (!f) { /* no resource report: the kernel's attributes start empty */
        if (em->n_fns == em->cap_fns) {
            int cap = em->cap_fns ? 2 * em->cap_fns : 8;
            emu_fn *nf = kvq_realloc(em->fns, (size_t)cap * sizeof *nf);
            if (!nf) {
                snprintf(msg, n, "out of memory");
                return KVQ_ERR_NOMEM;
            }
            em->fns = nf, em->cap_fns = cap;
        }
        f = &em->fns[em->n_fns++];
        memset(f, 0, sizeof *f);
        snprintf(f->name, sizeof f->name, "%s", kernel);
    }
    if ((unsigned long long)f->a.static_smem + bytes > e->smem_optin) {
        snprintf(msg, n,
                 "emu: cuFuncSetAttribute(%s, MAX_DYNAMIC_SHARED_SIZE_BYTES, %u): with its %u bytes of static shared "
                 "memory, more than the %u a block of %s may have (CUDA_ERROR_INVALID_VALUE)",
                 kernel, bytes, f->a.static_smem, e->smem_optin, e->target);
        return KVQ_ERR_INTERNAL;
    }
    f->a.max_dyn_smem = bytes;
    return KVQ_OK;
}

/* The kernel's entry, looked up in the shared object the first time and cached in the module. */
static const struct emu_kernel *emu_kernel_of(emu_mod *em, const char *kernel, char *msg, size_t n)
{
    for (int i = 0; i < em->n_syms; i++)
        if (!strcmp(em->syms[i].name, kernel)) return em->syms[i].k;
    char sym[96];
    snprintf(sym, sizeof sym, "%s__emu", kernel);
    const struct emu_kernel *k = dlsym(em->so, sym);
    if (!k) {
        snprintf(msg, n, "emu: no kernel %s in the module", kernel);
        return NULL;
    }
    if (em->n_syms == em->cap_syms) {
        int cap = em->cap_syms ? 2 * em->cap_syms : 32;
        struct emu_sym *ns = kvq_realloc(em->syms, (size_t)cap * sizeof *ns);
        if (!ns) return k; /* not cached: looked up again next time */
        em->syms = ns, em->cap_syms = cap;
    }
    if (strlen(kernel) < sizeof em->syms[0].name) {
        snprintf(em->syms[em->n_syms].name, sizeof em->syms[0].name, "%s", kernel);
        em->syms[em->n_syms++].k = k;
    }
    return k;
}

static kvq_status emu_launch_k(cu_dev *d, cu_module *m, const char *kernel, const unsigned grid[3],
                               const unsigned block[3], unsigned smem, const void *params, size_t size, char *msg,
                               size_t n)
{
    if (no_context(d, "cuLaunchKernel", msg, n)) return KVQ_ERR_INTERNAL;
    emu_dev *e = d->impl;
    emu_mod *em = m->impl;
    const struct emu_kernel *k = emu_kernel_of(em, kernel, msg, n);
    if (!k) return KVQ_ERR_INTERNAL;
    emu_dim3 g = {grid[0], grid[1], grid[2]}, b = {block[0], block[1], block[2]};
    struct emu_options opt;
    memset(&opt, 0, sizeof opt);
    const char *seed = getenv("KVQ_EMU_SHUFFLE");
    if (seed && *seed) opt.shuffle_seed = strtoull(seed, NULL, 10);
    /* the driver's checks of the launch: the kernel's attributes, the emulated GPU's shared memory */
    const emu_fn *f = find_fn(em, kernel);
    opt.attrs = f ? &f->a : NULL;
    opt.smem_optin = e->smem_optin;
    struct emu_error err;
    memset(&err, 0, sizeof err);
    emu_status st = em->launch(k, g, b, smem, params, size, &opt, &err);
    if (st == EMU_ERR_CONFIG || st == EMU_ERR_RESOURCES) {
        snprintf(msg, n, "emu: launch of %s refused as %s would refuse it: %s", kernel, e->target, err.msg);
        return KVQ_ERR_INTERNAL;
    }
    if (st != EMU_OK) {
        snprintf(msg, n, "emu: %s failed: %s", kernel, err.msg);
        return st == EMU_ERR_NOMEM ? KVQ_ERR_NOMEM : KVQ_ERR_INTERNAL;
    }
    return KVQ_OK;
}

static void emu_close(cu_dev *d)
{
    if (emu_current == ((const emu_dev *)d->impl)->ctx) emu_current = 0;
    kvq_free(d->impl);
}

int cu_emu_occupancy(cu_module *m, const char *kernel, int threads, size_t smem)
{
    const emu_dev *e = m->dev->impl;
    const emu_fn *f = find_fn(m->impl, kernel);
    const int sm = atoi(e->target + 3); /* "sm_90" */
    return plan_ctas_per_sm(sm, threads, smem + (f ? f->a.static_smem : 0), f ? (int)f->a.regs : 0);
}

static const cu_dev_ops emu_ops = {
    .alloc = emu_alloc,
    .free = emu_free,
    .alloc_host = emu_alloc_host,
    .free_host = emu_free_host,
    .memset = emu_memset,
    .h2d_async = emu_h2d,
    .d2h_async = emu_d2h,
    .sync = emu_sync,
    .event_create = emu_event_create,
    .event_destroy = emu_event_destroy,
    .event_record = emu_event_record,
    .event_wait = emu_event_wait,
    .load = emu_load,
    .module_free = emu_module_free,
    .launch = emu_launch_k,
    .max_dyn_smem = emu_max_dyn_smem,
    .enter = emu_enter,
    .leave = emu_leave,
    .close = emu_close,
};

kvq_status cu_emu_open(cu_dev *d, char *msg, size_t n)
{
    emu_dev *e = kvq_calloc(1, sizeof *e);
    if (!e) return KVQ_ERR_NOMEM;
    const char *cc = getenv("KVQ_EMU_CC"), *cxx = getenv("KVQ_EMU_CXX"), *opt = getenv("KVQ_EMU_OPT");
    snprintf(e->cc, sizeof e->cc, "%s", cc && *cc ? cc : "cc");
    snprintf(e->cxx, sizeof e->cxx, "%s", cxx && *cxx ? cxx : "c++");
    snprintf(e->opt, sizeof e->opt, "%s", opt && *opt ? opt : "-O1");
    const char *san = getenv("KVQ_EMU_SANITIZE");
    e->san = san && !strcmp(san, "0") ? "" : san && !strcmp(san, "address") ? EMU_ASAN : EMU_SAN;
    const char *res = getenv("KVQ_EMU_RESOURCES");
    e->resources = !(res && !strcmp(res, "0"));
    snprintf(e->emu_dir, sizeof e->emu_dir, "%s/tests/emu", kvq_data_dir());
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/emu_cuda.h", e->emu_dir);
    if (!file_exists(probe)) {
        snprintf(msg, n, "emu: unavailable: the emulator's sources are not at %s (set KVQ_SRCDIR to the kvq checkout)",
                 e->emu_dir);
        kvq_free(e);
        return KVQ_ERR_UNAVAILABLE;
    }
    /* the GPU whose limits launches are checked against: $KVQ_EMU_ARCH, sm_80 or sm_90 (the default) */
    const char *arch = getenv("KVQ_EMU_ARCH");
    if (arch && *arch && strcmp(arch, "sm_80") && strcmp(arch, "sm_90")) {
        snprintf(msg, n, "emu: KVQ_EMU_ARCH=%s: the emulator models sm_80 or sm_90", arch);
        kvq_free(e);
        return KVQ_ERR_INVALID;
    }
    snprintf(e->target, sizeof e->target, "%s", arch && *arch ? arch : "sm_90");
    e->smem_optin = !strcmp(e->target, "sm_80") ? EMU_SMEM_OPTIN_SM80 : EMU_SMEM_OPTIN_SM90;
    d->ops = &emu_ops;
    d->impl = e;
    snprintf(d->arch, sizeof d->arch, "emu");
    /* $KVQ_EMU_SMS: the SM count the plan sizes its split for (kvqc build's cost model: 132, an H100's) */
    const char *sms = getenv("KVQ_EMU_SMS");
    d->sm_count = sms && atoi(sms) > 0 && atoi(sms) <= 1024 ? atoi(sms) : 4;
    e->ctx = __atomic_add_fetch(&emu_ctx_ids, 1, __ATOMIC_RELAXED);
    emu_current = e->ctx; /* current on the opening thread, as cu_driver_open's context is */
    return KVQ_OK;
}
