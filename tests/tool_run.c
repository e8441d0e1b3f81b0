/* tool_run.h: fork + exec of a built tool with its output captured (shared by the tool tests). */
#include "tool_run.h"

#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    size_t cap = 1 << 16, n = 0;
    char *buf = calloc(1, cap);
    if (f && buf) {
        n = fread(buf, 1, cap - 1, f);
        buf[n] = '\0';
    }
    if (f) fclose(f);
    return buf;
}

static double now(void)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + tv.tv_usec * 1e-6;
}

int th_tool_path(const char *name, char *out, size_t size)
{
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return -1;
    self[n] = '\0';
    for (int i = 0; i < 2; i++) { /* .../BUILD/tests/test_x -> .../BUILD */
        char *slash = strrchr(self, '/');
        if (slash) *slash = '\0';
    }
    snprintf(out, size, "%s/%s", self, name);
    return access(out, X_OK) == 0 ? 0 : -1;
}

th_run_result th_run(const char *tool, const char *scratch, const char *const *args, unsigned timeout_s)
{
    char outp[PATH_MAX], errp[PATH_MAX];
    snprintf(outp, sizeof outp, "%s/stdout", scratch);
    snprintf(errp, sizeof errp, "%s/stderr", scratch);
    const char *argv[64];
    int n = 0;
    argv[n++] = tool;
    for (int i = 0; args[i] && n < 63; i++) argv[n++] = args[i];
    argv[n] = NULL;
    fflush(stdout);
    double t0 = now();
    pid_t pid = fork();
    if (pid == 0) {
        int o = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0644), e = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0 || chdir(th_srcdir()) != 0) _exit(127);
        if (timeout_s) alarm(timeout_s);
        execv(tool, (char *const *)argv);
        _exit(127);
    }
    th_run_result r = {-1000, NULL, NULL, 0, 0};
    int st;
    struct rusage ru;
    if (pid > 0 && wait4(pid, &st, 0, &ru) == pid) {
        r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
        r.max_rss_kb = ru.ru_maxrss;
    }
    r.seconds = now() - t0;
    r.out = slurp(outp);
    r.err = slurp(errp);
    return r;
}

void th_run_free(th_run_result *r)
{
    free(r->out);
    free(r->err);
    r->out = r->err = NULL;
}

void th_run_check_clean(const th_run_result *r)
{
    TH_CHECK(r->status >= 0 && r->status <= 2, "exit status %d (a crash, a leak or a sanitizer report); stderr:\n%s",
             r->status, r->err ? r->err : "");
    TH_CHECK(r->err && !strstr(r->err, "Sanitizer") && !strstr(r->err, "runtime error"), "sanitizer report:\n%s",
             r->err ? r->err : "");
}
