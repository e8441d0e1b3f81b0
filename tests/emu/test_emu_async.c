/* Emulator: cp.async. A tiled matrix product with double buffering matches a plain product on awkward shapes
 * (edges zero-filled by the copies) in order and shuffled; leaving out the cp.async wait, waiting with
 * wait_group 1 while the tile needed is the newest group, or the barrier that protects a buffer before it is
 * refilled, gives wrong results every time. */
#include <math.h>
#include <stdlib.h>

#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(matmul_tiled);

struct mm {
    int m, n, k;
    float *a, *b, *c;
    double *want;
};

static void mm_init(struct mm *x, int m, int n, int k)
{
    uint64_t seed = (uint64_t)(m * 1000003 + n * 1009 + k);
    x->m = m, x->n = n, x->k = k;
    x->a = malloc((size_t)m * k * sizeof *x->a);
    x->b = malloc((size_t)k * n * sizeof *x->b);
    x->c = malloc((size_t)m * n * sizeof *x->c);
    x->want = calloc((size_t)m * n, sizeof *x->want);
    for (int i = 0; i < m * k; i++) x->a[i] = (float)((int)(test_rand(&seed) % 201) - 100) / 64.0f;
    for (int i = 0; i < k * n; i++) x->b[i] = (float)((int)(test_rand(&seed) % 201) - 100) / 64.0f;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++)
            for (int l = 0; l < k; l++) x->want[i * n + j] += (double)x->a[i * k + l] * x->b[l * n + j];
}

static void mm_free(struct mm *x)
{
    free(x->a);
    free(x->b);
    free(x->c);
    free(x->want);
}

static int mm_run(struct mm *x, int bug, uint64_t seed)
{
    for (int i = 0; i < x->m * x->n; i++) x->c[i] = -12345.0f;
    struct matmul_params p = {x->a, x->b, x->c, x->m, x->n, x->k, bug};
    struct emu_options opt = {.shuffle_seed = seed, .stack_size = 0, .stats = NULL};
    struct emu_error e;
    emu_dim3 grid = {(unsigned)(x->n + MM_TILE - 1) / MM_TILE, (unsigned)(x->m + MM_TILE - 1) / MM_TILE, 1};
    emu_status s = emu_launch(EMU_KERNEL(matmul_tiled), grid, d3(MM_TILE, MM_TILE, 1), 0, &p, sizeof p, &opt, &e);
    TH_CHECK(s == EMU_OK, "launch: %s", e.msg);
    return s == EMU_OK;
}

/* Index of the first element off by more than rounding, or -1. */
static int mm_first_wrong(const struct mm *x)
{
    for (int i = 0; i < x->m * x->n; i++)
        if (!(fabs(x->c[i] - x->want[i]) <= 1e-5 * x->k)) return i;
    return -1;
}

int main(void)
{
    static const int shapes[][3] = {{16, 16, 16}, {37, 44, 52}, {64, 32, 128}, {1, 4, 4}, {5, 8, 200}, {33, 100, 36}};
    for (unsigned s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        struct mm x;
        mm_init(&x, shapes[s][0], shapes[s][1], shapes[s][2]);
        th_begin("emu cp.async double-buffered matmul %dx%dx%d", x.m, x.n, x.k);
        if (mm_run(&x, 0, 0)) {
            int i = mm_first_wrong(&x);
            TH_CHECK(i < 0, "C[%d][%d] = %g, want %g", i / x.n, i % x.n, i < 0 ? 0 : x.c[i], i < 0 ? 0 : x.want[i]);
        }
        th_end();
        mm_free(&x);
    }

    struct mm x;
    mm_init(&x, 37, 44, 52);
    th_begin("emu cp.async matmul: same bits under 6 shuffle seeds");
    float *ref = malloc((size_t)x.m * x.n * sizeof *ref);
    mm_run(&x, 0, 0);
    memcpy(ref, x.c, (size_t)x.m * x.n * sizeof *ref);
    for (uint64_t seed = 1; seed <= 6 && !th_failed(); seed++) {
        mm_run(&x, 0, seed);
        TH_CHECK(!memcmp(ref, x.c, (size_t)x.m * x.n * sizeof *ref), "seed %llu changed the result",
                 (unsigned long long)seed);
    }
    free(ref);
    th_end();

    th_begin("emu catches a missing cp.async wait (wrong data, every run)");
    for (uint64_t seed = 0; seed < 3 && !th_failed(); seed++)
        if (mm_run(&x, 1, seed)) TH_CHECK(mm_first_wrong(&x) >= 0, "seed %llu: result correct without the wait",
                                          (unsigned long long)seed);
    th_end();

    th_begin("emu: wait_group 1 leaves the newest committed group in flight (wait before the next tile's commit)");
    for (uint64_t seed = 0; seed < 3 && !th_failed(); seed++)
        if (mm_run(&x, 3, seed)) TH_CHECK(mm_first_wrong(&x) >= 0, "seed %llu: result correct with the newest group "
                                          "unwaited", (unsigned long long)seed);
    th_end();

    th_begin("emu catches a buffer refilled before every thread has read it (missing barrier)");
    for (uint64_t seed = 0; seed < 3 && !th_failed(); seed++)
        if (mm_run(&x, 2, seed)) TH_CHECK(mm_first_wrong(&x) >= 0, "seed %llu: result correct without the barrier",
                                          (unsigned long long)seed);
    th_end();
    mm_free(&x);
    emu_release();
    return th_summary();
}
