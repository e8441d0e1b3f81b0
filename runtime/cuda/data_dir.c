/* Where the emu and cuda backends find what they read at run time: the CUDA templates (templates/), the SIMT
 * emulator's sources (tests/emu/) and kernels built ahead of time (generated/). A checkout has them at its root;
 * `make install` copies them to PREFIX/share/kvq with the same shape, so an installed library finds them beside
 * itself (dladdr), wherever PREFIX was moved to. $KVQ_SRCDIR overrides both. */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kvq.h"

#ifndef KVQ_SOURCE_DIR
#define KVQ_SOURCE_DIR "."
#endif

static char installed_dir[PATH_MAX + 32];
static pthread_once_t installed_once = PTHREAD_ONCE_INIT;

/* <dir of the object holding this code>/../share/kvq, if it holds the emulator's sources. The object is
 * libkvq.so, or the executable libkvq.a was linked into (glibc then reports argv[0], which may be relative or a
 * bare name: /proc/self/exe is the reliable path). */
static void find_installed(void)
{
    Dl_info info;
    char obj[PATH_MAX], real[PATH_MAX];
    installed_dir[0] = 0;
    if (!dladdr((void *)find_installed, &info) || !info.dli_fname) return;
    snprintf(obj, sizeof obj, "%s", info.dli_fname);
    if (!strchr(obj, '/') || !realpath(obj, real)) {
        ssize_t n = readlink("/proc/self/exe", real, sizeof real - 1);
        if (n <= 0) return;
        real[n] = 0;
    }
    char *slash = strrchr(real, '/');
    if (!slash) return;
    *slash = 0;
    char probe[PATH_MAX + 64];
    struct stat sb;
    snprintf(probe, sizeof probe, "%s/../share/kvq/tests/emu/emu_cuda.h", real);
    if (stat(probe, &sb) != 0) return;
    snprintf(probe, sizeof probe, "%s/../share/kvq", real);
    if (!realpath(probe, installed_dir)) installed_dir[0] = 0;
}

const char *kvq_data_dir(void)
{
    const char *s = getenv("KVQ_SRCDIR");
    if (s && *s) return s;
    pthread_once(&installed_once, find_installed);
    return installed_dir[0] ? installed_dir : KVQ_SOURCE_DIR;
}

void kvq_generated_dir(const char *scheme, char *out, size_t size)
{
    const char *gen = getenv("KVQ_GENERATED_DIR");
    if (gen && *gen) snprintf(out, size, "%s/%s", gen, scheme);
    else snprintf(out, size, "%s/generated/%s", kvq_data_dir(), scheme);
}
