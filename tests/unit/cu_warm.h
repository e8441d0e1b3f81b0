/* The start of a GPU test program (test_cuda_backend, its GPU build tests/gpu/test_gpu_backend.c, and
 * test_cuda_fakedrv): the kernel cache is filled by child processes forked BEFORE this process initialises the
 * device, then this process probes. A process that initialised CUDA must not fork a child that uses it (the
 * driver's state does not survive fork: the child's calls fail or hang), and the parent waits for the children
 * for at most a bounded time, killing them after it. Header-only: one test program includes it once. */
#ifndef KVQ_TEST_CU_WARM_H
#define KVQ_TEST_CU_WARM_H

#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Runs job(i) for i in [0, n_jobs) in `workers` child processes (a job's non-zero answer fails its child), then
 * waits at most timeout_s seconds for them. Returns 0 when every child exited 0; otherwise -1 with why. */
static int cu_warm_children(int n_jobs, int workers, int (*job)(int), int timeout_s, char *why, size_t why_n)
{
    pid_t pid[8];
    if (workers > 8) workers = 8;
    fflush(stdout);
    for (int w = 0; w < workers; w++) {
        pid[w] = fork();
        if (pid[w] == 0) {
            int bad = 0;
            for (int i = w; i < n_jobs; i += workers) bad |= job(i) != 0;
            _exit(bad);
        }
    }
    int rc = 0;
    struct timespec t0, now, tick = {0, 20 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int w = 0; w < workers; w++) {
        if (pid[w] < 0) {
            snprintf(why, why_n, "fork failed");
            rc = -1;
            continue;
        }
        int status = 0;
        pid_t got;
        while ((got = waitpid(pid[w], &status, WNOHANG)) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (now.tv_sec - t0.tv_sec >= timeout_s) {
                kill(pid[w], SIGKILL);
                waitpid(pid[w], &status, 0);
                snprintf(why, why_n, "child %d did not finish in %d s (killed)", w, timeout_s);
                rc = -1;
                break;
            }
            nanosleep(&tick, NULL);
        }
        if (got == pid[w] && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
            snprintf(why, why_n, "child %d %s %d", w, WIFEXITED(status) ? "exited with" : "died of signal",
                     WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
            rc = -1;
        }
    }
    return rc;
}

/* The program's start: the cache filled in children first (n_jobs of job), then probe() in this process. Returns
 * probe's answer (0: the backend runs here); *warm_rc gets cu_warm_children's. */
static int cu_warm_then_probe(int n_jobs, int workers, int (*job)(int), int (*probe)(char *, size_t), int timeout_s,
                              int *warm_rc, char *why, size_t why_n)
{
    *warm_rc = cu_warm_children(n_jobs, workers, job, timeout_s, why, why_n);
    return probe(why, why_n);
}

#endif
