/* The cpu backend's kernels from IR to running code (emit_llvm.h, docs/cpu.md): the module of a kernel list and
 * its key, default<O3> and the object for a TargetMachine (one path for the JIT and `kvqc build --target cpu`),
 * the JIT cache, ORC LLJIT. The IR itself is emit_llvm.c's. */
#include "emit_llvm.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVQ_HAVE_LLVM
#include <llvm-c/Analysis.h>
#include <llvm-c/BitReader.h>
#include <llvm-c/BitWriter.h>
#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/Orc.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>
#include <pthread.h>
#include <unistd.h>

#include "alloc.h"
#include "emit_cuda.h" /* emit_cuda_sha256_hex: the one SHA-256 of the project */
#include "emit_llvm_ir.h"
#include "jit_cache.h"

/* ----------------------------------------------------- module, key, object, JIT (and kvqc build --target cpu) -- */

static pthread_once_t init_once = PTHREAD_ONCE_INIT;
static int init_failed;
static void init_llvm(void)
{
    init_failed = LLVMInitializeNativeTarget() || LLVMInitializeNativeAsmPrinter();
}

kvq_status emit_llvm_probe(char *msg, size_t msg_size)
{
    pthread_once(&init_once, init_llvm);
    if (init_failed) {
        snprintf(msg, msg_size, "LLVM has no native target for this host");
        return KVQ_ERR_UNAVAILABLE;
    }
    return KVQ_OK;
}

/* `name` ("+avx512vbmi") is one of the comma-separated features, not a prefix of another ("+avx512vbmi2"). */
static int has_feature(const char *features, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = features; p && (p = strstr(p, name)); p += n)
        if ((p == features || p[-1] == ',') && (p[n] == ',' || p[n] == 0)) return 1;
    return 0;
}

/* Vector lanes for a feature string: 16 with AVX-512F, 8 with AVX2, else 4; `force` (4, 8, 16) wins. */
static int width_for(const char *features, int force)
{
    force &= ~(EMIT_LLVM_NO_VNNI | EMIT_LLVM_NO_INT8);
    if (force == 4 || force == 8 || force == 16) return force;
    return features && strstr(features, "+avx512f") ? 16 : features && strstr(features, "+avx2") ? 8 : 4;
}

/* The integer paths (emit_llvm_ir_module's vnni): 16 lanes, AVX-512 VNNI and BW (vpdpwssd, vpdpbusd, 16-bit
 * shifts), not turned off by `force`: EMIT_LLVM_IR_VNNI, and EMIT_LLVM_IR_INT8 unless `force` says no int8, with
 * EMIT_LLVM_IR_VBMI when the host has AVX-512 VBMI (vpermt2b). */
static int vnni_for(const char *features, int width, int force)
{
    int on = width == 16 && !(force & EMIT_LLVM_NO_VNNI) && features && strstr(features, "+avx512vnni") &&
             strstr(features, "+avx512bw");
    int i8 = on && !(force & EMIT_LLVM_NO_INT8);
    int perm = width == 16 && features && strstr(features, "+avx512f") ? EMIT_LLVM_IR_PERM16 : 0;
    return perm | (!on ? 0 : EMIT_LLVM_IR_VNNI | (i8 ? EMIT_LLVM_IR_INT8 : 0) |
                                 (i8 && has_feature(features, "+avx512vbmi") ? EMIT_LLVM_IR_VBMI : 0));
}

int emit_llvm_host_width(int force)
{
    char *f = LLVMGetHostCPUFeatures();
    int w = width_for(f, force);
    LLVMDisposeMessage(f);
    return w;
}

void emit_llvm_version(char *out, size_t size)
{
    unsigned maj, min, patch;
    LLVMGetVersion(&maj, &min, &patch);
    snprintf(out, size, "%u.%u.%u", maj, min, patch);
}

struct emit_llvm_jit {
    LLVMOrcLLJITRef jit;
};

struct emit_llvm_module {
    LLVMContextRef ctx;
    LLVMModuleRef m;
    char *cpu, *features; /* kvq_malloc'd */
    int width, vnni, n, optimised;
    LLVMMemoryBufferRef bc; /* the unoptimised IR as bitcode: what the key hashes and $KVQ_LLVM_HELPER compiles */
    char key[65];
};


static kvq_status err_msg(LLVMErrorRef err, const char *what, char *msg, size_t msg_size)
{
    char *m = LLVMGetErrorMessage(err);
    snprintf(msg, msg_size, "%s: %s", what, m);
    LLVMDisposeErrorMessage(m);
    return KVQ_ERR_INTERNAL;
}

/* The TargetMachine of a module's target (the default triple: the host's architecture). */
static LLVMTargetMachineRef target_machine(const emit_llvm_module *mod, char *msg, size_t msg_size)
{
    char *triple = LLVMGetDefaultTargetTriple(), *err = NULL;
    LLVMTargetRef target;
    LLVMTargetMachineRef tm = NULL;
    if (LLVMGetTargetFromTriple(triple, &target, &err)) {
        snprintf(msg, msg_size, "LLVM target %s: %s", triple, err ? err : "?");
        LLVMDisposeMessage(err);
    } else {
        tm = LLVMCreateTargetMachine(target, triple, mod->cpu, mod->features, LLVMCodeGenLevelAggressive,
                                     LLVMRelocPIC, LLVMCodeModelJITDefault);
        if (!tm) snprintf(msg, msg_size, "LLVM could not create a target machine for %s", triple);
    }
    LLVMDisposeMessage(triple);
    return tm;
}



static const char PIPELINE[] = "default<O3>";

/* The key of the bitcode bc for cpu and features: everything the object depends on (DESIGN §7). */
static void key_of(const char *bc, size_t nbc, const char *cpu, const char *features, char key[65])
{
    char ver[32];
    emit_llvm_version(ver, sizeof ver);
    size_t n = nbc + strlen(cpu) + strlen(features) + 128;
    char *all = malloc(n);
    if (all) {
        int len = snprintf(all, n, "%s\nLLVM %s\n%s\n%s\n%s\n", EMIT_LLVM_KVQ_VERSION, ver, cpu, features, PIPELINE);
        memcpy(all + len, bc, nbc);
        emit_cuda_sha256_hex(all, (size_t)len + nbc, key);
    } else {
        key[0] = 0; /* no key: no caching */
    }
    free(all);
}

static void module_key(emit_llvm_module *mod)
{
    /* The IR as bitcode: the same module gives the same bytes, and writing it is ~10x faster than printing text
     * (which formats every float constant). */
    mod->bc = LLVMWriteBitcodeToMemoryBuffer(mod->m);
    if (mod->bc) key_of(LLVMGetBufferStart(mod->bc), LLVMGetBufferSize(mod->bc), mod->cpu, mod->features, mod->key);
    else mod->key[0] = 0;
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = kvq_malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

void emit_llvm_module_free(emit_llvm_module *m)
{
    if (!m) return;
    if (m->bc) LLVMDisposeMemoryBuffer(m->bc);
    if (m->m) LLVMDisposeModule(m->m);
    if (m->ctx) LLVMContextDispose(m->ctx);
    kvq_free(m->cpu);
    kvq_free(m->features);
    kvq_free(m);
}

kvq_status emit_llvm_module_build(const emit_llvm_kernel *ks, int n, const emit_llvm_target *t,
                                  emit_llvm_module **out, char *msg, size_t msg_size)
{
    *out = NULL;
    kvq_status st = emit_llvm_probe(msg, msg_size);
    if (st != KVQ_OK) return st;
    for (int i = 0; i < n; i++)
        if (!emit_llvm_supported(&ks[i], msg, msg_size)) return KVQ_ERR_UNSUPPORTED;
    emit_llvm_module *mod = kvq_calloc(1, sizeof *mod);
    if (!mod) {
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    const char *cpu = t ? t->cpu : NULL, *feat = t ? t->features : NULL;
    char *hcpu = cpu ? NULL : LLVMGetHostCPUName();
    char *hfeat = feat || cpu ? NULL : LLVMGetHostCPUFeatures();
    mod->cpu = dup_str(cpu ? cpu : hcpu);
    mod->features = dup_str(feat ? feat : hfeat ? hfeat : "");
    LLVMDisposeMessage(hcpu);
    LLVMDisposeMessage(hfeat);
    if (!mod->cpu || !mod->features) {
        emit_llvm_module_free(mod);
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    mod->width = width_for(mod->features, t ? t->width : 0);
    mod->vnni = vnni_for(mod->features, mod->width, t ? t->width : 0);
    mod->n = n;
    mod->ctx = LLVMContextCreate();
    mod->m = emit_llvm_ir_module(mod->ctx, ks, n, mod->width, mod->vnni);
    char *verr = NULL;
    if (LLVMVerifyModule(mod->m, LLVMReturnStatusAction, &verr)) {
        snprintf(msg, msg_size, "cpu kernels: invalid IR: %.300s", verr ? verr : "?");
        st = KVQ_ERR_INTERNAL;
    }
    LLVMDisposeMessage(verr);
    if (st != KVQ_OK) {
        emit_llvm_module_free(mod);
        return st;
    }
    module_key(mod);
    *out = mod;
    return KVQ_OK;
}

const char *emit_llvm_module_key(const emit_llvm_module *m) { return m->key; }
const char *emit_llvm_module_cpu(const emit_llvm_module *m) { return m->cpu; }
const char *emit_llvm_module_features(const emit_llvm_module *m) { return m->features; }
int emit_llvm_module_width(const emit_llvm_module *m) { return m->width; }

kvq_status emit_llvm_module_object(emit_llvm_module *mod, void **obj, size_t *size, char *msg, size_t msg_size)
{
    *obj = NULL;
    *size = 0;
    if (mod->optimised) {
        snprintf(msg, msg_size, "cpu kernels: the module was compiled already");
        return KVQ_ERR_INTERNAL;
    }
    mod->optimised = 1;
    LLVMTargetMachineRef tm = target_machine(mod, msg, msg_size);
    if (!tm) return KVQ_ERR_UNAVAILABLE;
    kvq_status st = KVQ_OK;
    LLVMModuleRef m = mod->m;
    char *triple = LLVMGetTargetMachineTriple(tm);
    LLVMSetTarget(m, triple);
    LLVMDisposeMessage(triple);
    LLVMTargetDataRef dl = LLVMCreateTargetDataLayout(tm);
    char *dls = LLVMCopyStringRepOfTargetData(dl);
    LLVMSetDataLayout(m, dls);
    LLVMDisposeMessage(dls);
    LLVMDisposeTargetData(dl);
    LLVMPassBuilderOptionsRef po = LLVMCreatePassBuilderOptions();
    LLVMErrorRef err = LLVMRunPasses(m, PIPELINE, tm, po);
    LLVMDisposePassBuilderOptions(po);
    if (err) st = err_msg(err, "cpu kernels: optimisation", msg, msg_size);
    if (st == KVQ_OK) {
        char *em = NULL;
        LLVMMemoryBufferRef buf = NULL;
        if (LLVMTargetMachineEmitToMemoryBuffer(tm, m, LLVMObjectFile, &em, &buf)) {
            snprintf(msg, msg_size, "cpu kernels: code generation: %.300s", em ? em : "?");
            st = KVQ_ERR_INTERNAL;
        } else {
            size_t n = LLVMGetBufferSize(buf);
            *obj = kvq_malloc(n ? n : 1);
            if (*obj) {
                memcpy(*obj, LLVMGetBufferStart(buf), n);
                *size = n;
            } else {
                snprintf(msg, msg_size, "out of memory");
                st = KVQ_ERR_NOMEM;
            }
        }
        if (buf) LLVMDisposeMemoryBuffer(buf);
        LLVMDisposeMessage(em);
    }
    LLVMDisposeTargetMachine(tm);
    return st;
}

kvq_status emit_llvm_load(const void *obj, size_t size, int n, emit_llvm_jit **out, emit_llvm_tile_fn *fns,
                          char *msg, size_t msg_size)
{
    *out = NULL;
    kvq_status st = emit_llvm_probe(msg, msg_size);
    if (st != KVQ_OK) return st;
    emit_llvm_jit *j = kvq_calloc(1, sizeof *j);
    if (!j) {
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    LLVMErrorRef err = LLVMOrcCreateLLJIT(&j->jit, LLVMOrcCreateLLJITBuilder());
    if (err) {
        j->jit = NULL;
        st = err_msg(err, "cpu kernels: LLJIT", msg, msg_size);
    }
    if (st == KVQ_OK) {
        LLVMMemoryBufferRef buf = LLVMCreateMemoryBufferWithMemoryRangeCopy(obj, size, "kvq_cpu.o");
        err = LLVMOrcLLJITAddObjectFile(j->jit, LLVMOrcLLJITGetMainJITDylib(j->jit), buf); /* owns buf now */
        if (err) st = err_msg(err, "cpu kernels: loading the object", msg, msg_size);
    }
    for (int i = 0; i < n && st == KVQ_OK; i++) {
        char name[32];
        snprintf(name, sizeof name, "kvq_tile_%d", i);
        LLVMOrcExecutorAddress addr = 0;
        err = LLVMOrcLLJITLookup(j->jit, &addr, name);
        if (err) st = err_msg(err, "cpu kernels: lookup", msg, msg_size);
        else fns[i] = (emit_llvm_tile_fn)(uintptr_t)addr;
    }
    if (st != KVQ_OK) {
        emit_llvm_free(j);
        return st;
    }
    *out = j;
    return KVQ_OK;
}

/* $KVQ_LLVM_HELPER (tests/run.sh sets it to the plain build's tests/llvm-helper): a program built without the
 * sanitizers that optimises and compiles a module's bitcode into the cache (emit_llvm_cache_bitcode). In a process
 * under AddressSanitizer every one of LLVM's allocations goes through ASan's allocator, which makes default<O3> and
 * code generation several times as long (docs/testing.md, "Test time"). The same bitcode, CPU and features give the
 * same key and the same object bytes; a helper that fails, or keys differently (another build's), leaves no entry,
 * and the module is compiled here as without one. Returns 1 when the helper says it compiled. */
static int helper_compile(const char *helper, const emit_llvm_module *mod)
{
    char path[4300], base[4200];
    kvq_cache_path(mod->key, "bc", base, sizeof base);
    snprintf(path, sizeof path, "%s.tmp.%ld", base, (long)getpid());
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    size_t n = LLVMGetBufferSize(mod->bc);
    int ok = fwrite(LLVMGetBufferStart(mod->bc), 1, n, f) == n;
    if (fclose(f) != 0 || !ok) {
        unlink(path);
        return 0;
    }
    char *argv[] = {(char *)helper, mod->cpu, mod->features, path, NULL};
    ok = kvq_cache_run_helper(argv, NULL);
    unlink(path);
    return ok;
}

kvq_status emit_llvm_compile(const emit_llvm_kernel *ks, int n, int width, emit_llvm_prebuilt_fn prebuilt,
                             void *prebuilt_arg, emit_llvm_jit **out, emit_llvm_tile_fn *fns, int *origin,
                             char *msg, size_t msg_size)
{
    *out = NULL;
    if (origin) *origin = EMIT_LLVM_FROM_JIT;
    emit_llvm_target t = {NULL, NULL, width};
    emit_llvm_module *mod;
    kvq_status st = emit_llvm_module_build(ks, n, &t, &mod, msg, msg_size);
    if (st != KVQ_OK) return st;
    const char *key = mod->key;
    void *obj = NULL;
    size_t size = 0;
    char ignored[256];
    /* Prebuilt, then cached: a source whose object does not load is passed over. */
    for (int from = EMIT_LLVM_FROM_PREBUILT; from >= EMIT_LLVM_FROM_CACHE && key[0] && !*out; from--) {
        if (from == EMIT_LLVM_FROM_PREBUILT) {
            obj = prebuilt ? prebuilt(prebuilt_arg, key, &size) : NULL;
        } else if (!kvq_cache_get(key, "o", &obj, &size, 1)) {
            obj = NULL;
        }
        if (obj && emit_llvm_load(obj, size, n, out, fns, ignored, sizeof ignored) == KVQ_OK && origin)
            *origin = from;
        kvq_free(obj);
        obj = NULL;
    }
    /* One compile of a key at a time across processes (make test's programs share a cold cache): a second process
     * waits for the first's entry. */
    char lock[80];
    snprintf(lock, sizeof lock, "llvm-%s", key);
    const int lk = *out || !key[0] ? -1 : kvq_cache_lock(lock);
    if (lk >= 0 && kvq_cache_get(key, "o", &obj, &size, 1)) {
        if (emit_llvm_load(obj, size, n, out, fns, ignored, sizeof ignored) == KVQ_OK && origin)
            *origin = EMIT_LLVM_FROM_CACHE;
        kvq_free(obj);
        obj = NULL;
    }
    const char *helper = getenv("KVQ_LLVM_HELPER");
    if (!*out && key[0] && helper && *helper && helper_compile(helper, mod) &&
        kvq_cache_get(key, "o", &obj, &size, 1)) {
        emit_llvm_load(obj, size, n, out, fns, ignored, sizeof ignored); /* compiled for this call: origin JIT */
        kvq_free(obj);
        obj = NULL;
    }
    if (!*out) {
        st = emit_llvm_module_object(mod, &obj, &size, msg, msg_size);
        if (st == KVQ_OK && key[0]) {
            kvq_cache_section s = {obj, size};
            kvq_cache_put(key, "o", &s, 1);
        }
        if (st == KVQ_OK) st = emit_llvm_load(obj, size, n, out, fns, msg, msg_size);
        kvq_free(obj);
    }
    kvq_cache_unlock(lock, lk);
    emit_llvm_module_free(mod);
    return st;
}

kvq_status emit_llvm_cache_bitcode(const void *bc, size_t size, const char *cpu, const char *features, char *msg,
                                   size_t msg_size)
{
    kvq_status st = emit_llvm_probe(msg, msg_size);
    if (st != KVQ_OK) return st;
    char key[65];
    key_of(bc, size, cpu, features, key);
    void *obj = NULL;
    size_t osize = 0;
    if (!key[0] || !kvq_cache_dir()[0]) {
        snprintf(msg, msg_size, "cpu kernels: no JIT cache to write to");
        return KVQ_ERR_UNAVAILABLE;
    }
    if (kvq_cache_get(key, "o", &obj, &osize, 1)) { /* another process compiled it meanwhile */
        kvq_free(obj);
        return KVQ_OK;
    }
    emit_llvm_module *mod = kvq_calloc(1, sizeof *mod);
    if (!mod || !(mod->cpu = dup_str(cpu)) || !(mod->features = dup_str(features))) {
        emit_llvm_module_free(mod);
        snprintf(msg, msg_size, "out of memory");
        return KVQ_ERR_NOMEM;
    }
    mod->ctx = LLVMContextCreate();
    LLVMMemoryBufferRef buf = LLVMCreateMemoryBufferWithMemoryRange(bc, size, "kvq_cpu.bc", 0);
    if (LLVMParseBitcodeInContext2(mod->ctx, buf, &mod->m)) {
        mod->m = NULL;
        snprintf(msg, msg_size, "cpu kernels: the bitcode does not parse");
        st = KVQ_ERR_INVALID;
    }
    LLVMDisposeMemoryBuffer(buf);
    if (st == KVQ_OK) st = emit_llvm_module_object(mod, &obj, &osize, msg, msg_size);
    if (st == KVQ_OK) {
        kvq_cache_section sec = {obj, osize};
        if (kvq_cache_put(key, "o", &sec, 1) != 0) {
            snprintf(msg, msg_size, "cpu kernels: could not write the cache entry");
            st = KVQ_ERR_IO;
        }
    }
    kvq_free(obj);
    emit_llvm_module_free(mod);
    return st;
}

void emit_llvm_free(emit_llvm_jit *j)
{
    if (!j) return;
    if (j->jit) {
        LLVMErrorRef err = LLVMOrcDisposeLLJIT(j->jit);
        if (err) LLVMConsumeError(err);
    }
    kvq_free(j);
}

char *emit_llvm_ir_text(const emit_llvm_kernel *k, int width)
{
    char msg[256];
    if (emit_llvm_probe(msg, sizeof msg) != KVQ_OK || !emit_llvm_supported(k, msg, sizeof msg)) return NULL;
    LLVMContextRef ctx = LLVMContextCreate();
    char *hf = LLVMGetHostCPUFeatures();
    int w = width_for(hf, width);
    LLVMModuleRef m = emit_llvm_ir_module(ctx, k, 1, w, vnni_for(hf, w, width));
    LLVMDisposeMessage(hf);
    char *s = LLVMPrintModuleToString(m), *copy = s ? strdup(s) : NULL;
    LLVMDisposeMessage(s);
    LLVMDisposeModule(m);
    LLVMContextDispose(ctx);
    return copy;
}

#else /* built without LLVM */

kvq_status emit_llvm_probe(char *msg, size_t msg_size)
{
    snprintf(msg, msg_size, "built without LLVM (install llvm-19-dev and rebuild)");
    return KVQ_ERR_UNAVAILABLE;
}
int emit_llvm_host_width(int force) { return force & 0xff ? force & 0xff : 4; }
void emit_llvm_version(char *out, size_t size) { snprintf(out, size, "none"); }
kvq_status emit_llvm_module_build(const emit_llvm_kernel *kernels, int n, const emit_llvm_target *t,
                                  emit_llvm_module **out, char *msg, size_t msg_size)
{
    (void)kernels, (void)n, (void)t;
    *out = NULL;
    return emit_llvm_probe(msg, msg_size);
}
const char *emit_llvm_module_key(const emit_llvm_module *m) { return (void)m, ""; }
const char *emit_llvm_module_cpu(const emit_llvm_module *m) { return (void)m, ""; }
const char *emit_llvm_module_features(const emit_llvm_module *m) { return (void)m, ""; }
int emit_llvm_module_width(const emit_llvm_module *m) { return (void)m, 4; }
kvq_status emit_llvm_module_object(emit_llvm_module *m, void **obj, size_t *size, char *msg, size_t msg_size)
{
    (void)m;
    *obj = NULL;
    *size = 0;
    return emit_llvm_probe(msg, msg_size);
}
void emit_llvm_module_free(emit_llvm_module *m) { (void)m; }
kvq_status emit_llvm_load(const void *obj, size_t size, int n, emit_llvm_jit **out, emit_llvm_tile_fn *fns,
                          char *msg, size_t msg_size)
{
    (void)obj, (void)size, (void)n, (void)fns;
    *out = NULL;
    return emit_llvm_probe(msg, msg_size);
}
kvq_status emit_llvm_compile(const emit_llvm_kernel *kernels, int n, int width, emit_llvm_prebuilt_fn prebuilt,
                             void *prebuilt_arg, emit_llvm_jit **out, emit_llvm_tile_fn *fns, int *origin,
                             char *msg, size_t msg_size)
{
    (void)kernels, (void)n, (void)width, (void)prebuilt, (void)prebuilt_arg, (void)fns;
    if (origin) *origin = EMIT_LLVM_FROM_JIT;
    *out = NULL;
    return emit_llvm_probe(msg, msg_size);
}
kvq_status emit_llvm_cache_bitcode(const void *bc, size_t size, const char *cpu, const char *features, char *msg,
                                   size_t msg_size)
{
    (void)bc, (void)size, (void)cpu, (void)features;
    return emit_llvm_probe(msg, msg_size);
}
void emit_llvm_free(emit_llvm_jit *j) { (void)j; }
char *emit_llvm_ir_text(const emit_llvm_kernel *k, int width)
{
    (void)k;
    (void)width;
    return NULL;
}

#endif
