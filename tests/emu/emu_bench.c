/* Measures how many thread-barrier crossings per second the emulator sustains: blocks of 128 threads that meet
 * at a barrier every few instructions. Checks the result against the same computation done serially, and ends
 * with "barrier crossings per second: N". Exit status 1 when the rate is under the 1e6 the emulator promises. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "emu.h"
#include "params.h"

EMU_KERNEL_DECLARE(barrier_bench);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int check(const unsigned *out, unsigned blocks, unsigned n, int iters)
{
    unsigned *x = malloc(n * sizeof *x), *s = malloc(n * sizeof *s);
    int ok = 1;
    for (unsigned t = 0; t < n; t++) x[t] = t;
    for (int i = 0; i < iters; i++) {
        memcpy(s, x, n * sizeof *x);
        for (unsigned t = 0; t < n; t++) x[t] = x[t] * 3u + s[(t + 1) % n];
    }
    for (unsigned b = 0; b < blocks; b++) ok &= !memcmp(out + b * n, x, n * sizeof *x);
    free(x);
    free(s);
    return ok;
}

static double launch_time(struct bench_params *p, unsigned blocks, unsigned n, struct emu_stats *st)
{
    emu_dim3 grid = {blocks, 1, 1}, block = {n, 1, 1};
    struct emu_options opt = {.shuffle_seed = 0, .stack_size = 0, .stats = st};
    struct emu_error err;
    double t0 = now();
    emu_status s = emu_launch(&barrier_bench__emu, grid, block, 0, p, sizeof *p, &opt, &err);
    double t = now() - t0;
    if (s != EMU_OK) {
        printf("emu_bench: launch failed: %s\n", err.msg);
        exit(1);
    }
    return t;
}

int main(int argc, char **argv)
{
    unsigned n = 128, blocks = 8, plain_blocks = 20000;
    int iters = argc > 1 ? atoi(argv[1]) : 2000;
    unsigned *out = calloc((size_t)plain_blocks * n, sizeof *out);
    struct emu_stats st;
    /* Without iterations the kernel never reaches a barrier: its blocks run plainly. */
    struct bench_params p = {0, out};
    double t = launch_time(&p, plain_blocks, n, &st);
    printf("plain blocks (no barrier, %u of %u threads): %.0f threads per second\n", plain_blocks, n,
           (double)st.threads / t);
    p.iters = iters;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        t = launch_time(&p, blocks, n, &st);
        if (st.barrier_crossings / t > best) best = (double)st.barrier_crossings / t;
    }
    int ok = check(out, blocks, n, iters);
    if (!ok) printf("emu_bench: wrong result\n");
    printf("%u blocks of %u threads, %d iterations of 2 barriers: %llu crossings per launch, %llu fiber switches\n",
           blocks, n, iters, (unsigned long long)st.barrier_crossings, (unsigned long long)st.switches);
    if (best < 1e6) printf("emu_bench: under the promised 1e6 crossings per second\n");
    emu_release();
    free(out);
    printf("barrier crossings per second: %.0f\n", best);
    return ok && best >= 1e6 ? 0 : 1;
}
