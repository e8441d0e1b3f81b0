/* The JIT cache on disk (DESIGN §7), shared by the cuda backend (NVRTC cubins) and the cpu backend (LLVM
 * objects): see jit_cache.h. */
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "alloc.h"
#include "jit_cache.h"
#include "emit_cuda.h"

extern char **environ;

#define CACHE_MAGIC "KVQCACH1"

static char cache_dir[4096];
static int cache_dir_done;

/* mkdir -p */
static int make_dirs(char *path)
{
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        int r = mkdir(path, 0755);
        *p = '/';
        if (r != 0 && errno != EEXIST) return -1;
    }
    return mkdir(path, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

const char *kvq_cache_dir(void)
{
    /* Re-read each time the environment may have changed (tests point it elsewhere). */
    const char *env = getenv("KVQ_CACHE_DIR");
    const char *home = getenv("HOME");
    char want[4096];
    if (env && *env)
        snprintf(want, sizeof want, "%s", env);
    else if (home && *home)
        snprintf(want, sizeof want, "%s/.cache/kvq", home);
    else
        want[0] = 0;
    if (cache_dir_done && strcmp(want, cache_dir) == 0) return cache_dir;
    snprintf(cache_dir, sizeof cache_dir, "%s", want);
    cache_dir_done = 1;
    if (cache_dir[0] && make_dirs(cache_dir) != 0) cache_dir[0] = 0;
    return cache_dir;
}

void kvq_cache_path(const char *key, const char *ext, char *out, size_t size)
{
    snprintf(out, size, "%s/%s.%s", kvq_cache_dir(), key, ext);
}

static void put_u64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static uint64_t get_u64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

int kvq_cache_get(const char *key, const char *ext, void **sections, size_t *sizes, int n)
{
    for (int i = 0; i < n; i++) sections[i] = NULL, sizes[i] = 0;
    if (!kvq_cache_dir()[0]) return 0;
    char path[4200];
    kvq_cache_path(key, ext, path, sizeof path);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    unsigned char hdr[8 + 8 + 32];
    unsigned char *buf = NULL;
    int ok = 0;
    if (fread(hdr, 1, sizeof hdr, f) == sizeof hdr && memcmp(hdr, CACHE_MAGIC, 8) == 0) {
        uint64_t size = get_u64(hdr + 8);
        if (size < ((uint64_t)1 << 32) && (buf = kvq_malloc(size ? (size_t)size : 1)) != NULL &&
            fread(buf, 1, (size_t)size, f) == size && fgetc(f) == EOF) {
            unsigned char d[32];
            emit_cuda_sha256(buf, (size_t)size, d);
            if (memcmp(d, hdr + 16, 32) == 0) {
                /* sections: n x (u64 size, bytes) */
                size_t off = 0;
                ok = 1;
                for (int i = 0; i < n && ok; i++) {
                    if (off + 8 > size) {
                        ok = 0;
                        break;
                    }
                    uint64_t s = get_u64(buf + off);
                    off += 8;
                    if (s > size - off) {
                        ok = 0;
                        break;
                    }
                    sections[i] = kvq_malloc((size_t)s + 1); /* +1: text sections get a NUL */
                    if (!sections[i]) {
                        ok = 0;
                        break;
                    }
                    memcpy(sections[i], buf + off, (size_t)s);
                    ((char *)sections[i])[s] = 0;
                    sizes[i] = (size_t)s;
                    off += (size_t)s;
                }
                if (ok && off != size) ok = 0;
            }
        }
    }
    fclose(f);
    kvq_free(buf);
    if (!ok) {
        for (int i = 0; i < n; i++) {
            kvq_free(sections[i]);
            sections[i] = NULL, sizes[i] = 0;
        }
        unlink(path); /* corrupt or truncated: rebuilt by the caller */
    }
    return ok;
}

int kvq_cache_put(const char *key, const char *ext, const kvq_cache_section *sec, int n)
{
    if (!kvq_cache_dir()[0]) return -1;
    size_t size = 0;
    for (int i = 0; i < n; i++) size += 8 + sec[i].size;
    unsigned char *buf = kvq_malloc(size ? size : 1);
    if (!buf) return -1;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        put_u64(buf + off, sec[i].size);
        off += 8;
        if (sec[i].size) memcpy(buf + off, sec[i].data, sec[i].size);
        off += sec[i].size;
    }
    unsigned char hdr[48];
    memcpy(hdr, CACHE_MAGIC, 8);
    put_u64(hdr + 8, size);
    emit_cuda_sha256(buf, size, hdr + 16);
    char path[4200], tmp[4300];
    kvq_cache_path(key, ext, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    int rc = -1;
    FILE *f = fopen(tmp, "wb");
    if (f) {
        int w = fwrite(hdr, 1, sizeof hdr, f) == sizeof hdr && fwrite(buf, 1, size, f) == size;
        if (fclose(f) == 0 && w && rename(tmp, path) == 0) rc = 0;
        if (rc != 0) unlink(tmp);
    }
    kvq_free(buf);
    return rc;
}

int kvq_cache_lock(const char *name)
{
    if (!kvq_cache_dir()[0]) return -1;
    char path[4200];
    kvq_cache_path(name, "lock", path, sizeof path);
    /* The holder unlinks the file before it unlocks: a lock taken on a file that is no longer the one at `path`
     * (its holder removed it meanwhile) is taken again on the new one. */
    for (int tries = 0; tries < 100; tries++) {
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) return -1;
        int r;
        while ((r = flock(fd, LOCK_EX)) != 0 && errno == EINTR) {
        }
        if (r != 0) {
            close(fd);
            return -1;
        }
        struct stat a, b;
        if (fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return fd;
        close(fd);
    }
    return -1;
}

void kvq_cache_unlock(const char *name, int handle)
{
    if (handle < 0) return;
    char path[4200];
    kvq_cache_path(name, "lock", path, sizeof path);
    unlink(path);
    close(handle); /* releases the flock */
}

int kvq_cache_run_helper(char *const argv[], const char *child_var)
{
    size_t ne = 0;
    while (environ[ne]) ne++;
    char **env = kvq_malloc((ne + 2) * sizeof *env);
    if (!env) return 0;
    memcpy(env, environ, ne * sizeof *env);
    env[ne] = (char *)child_var; /* may be NULL */
    env[ne + 1] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, env);
    posix_spawn_file_actions_destroy(&fa);
    kvq_free(env);
    int status = 0;
    if (rc == 0)
        while (waitpid(pid, &status, 0) < 0)
            if (errno != EINTR) {
                status = -1;
                break;
            }
    return rc == 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
