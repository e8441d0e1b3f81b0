/* Emulator: block-level execution. Reductions over static and dynamic shared memory at several block and grid
 * sizes, counting barriers, built-in indices of a 3-D launch run plainly, shared and global atomics, the
 * shuffled mode on race-free kernels, and launch configurations the emulator must refuse: sizes, and the hardware
 * limits on shared memory and registers. */
#include <math.h>
#include <stdlib.h>

#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(block_sum);
EMU_KERNEL_DECLARE(block_sum_dyn);
EMU_KERNEL_DECLARE(sync_vote);
EMU_KERNEL_DECLARE(indices);
EMU_KERNEL_DECLARE(histogram);
EMU_KERNEL_DECLARE(smem_handoff);

static float *random_floats(int n, uint64_t seed)
{
    float *v = malloc((size_t)(n ? n : 1) * sizeof *v);
    for (int i = 0; i < n; i++) v[i] = (float)(test_rand(&seed) % 2001) / 1000.0f - 1.0f;
    return v;
}

static void check_sums(const float *in, int n, const float *out, unsigned grid, unsigned block)
{
    double want = 0, got = 0, mag = 0;
    for (int i = 0; i < n; i++) want += in[i], mag += fabs(in[i]);
    for (unsigned b = 0; b < grid; b++) got += out[b];
    TH_CHECK(fabs(got - want) <= 1e-5 * (mag + 1), "grid %u block %u n %d: sum %.9g, want %.9g", grid, block, n, got,
             want);
}

static void test_block_sum(void)
{
    static const unsigned blocks[] = {1, 2, 32, 128, 1024};
    static const int sizes[] = {1, 1000, 100000};
    static const unsigned grids[] = {1, 7};
    for (unsigned bi = 0; bi < sizeof blocks / sizeof *blocks; bi++)
        for (unsigned si = 0; si < sizeof sizes / sizeof *sizes; si++)
            for (unsigned gi = 0; gi < sizeof grids / sizeof *grids; gi++) {
                unsigned nt = blocks[bi], g = grids[gi];
                int n = sizes[si];
                th_begin("emu block_sum (static smem) block %u grid %u n %d", nt, g, n);
                float *in = random_floats(n, 1 + bi + si + gi), *out = calloc(g, sizeof *out);
                struct block_sum_params p = {in, out, n};
                struct emu_stats st;
                struct emu_options opt = {.shuffle_seed = 0, .stack_size = 0, .stats = &st};
                LAUNCH_OK(EMU_KERNEL(block_sum), d3(g, 1, 1), d3(nt, 1, 1), 0, &p, &opt);
                check_sums(in, n, out, g, nt);
                unsigned levels = 1;
                for (unsigned h = nt / 2; h > 0; h /= 2) levels++;
                TH_CHECK(st.barrier_crossings == (uint64_t)g * nt * levels, "%llu barrier crossings, want %llu",
                         (unsigned long long)st.barrier_crossings, (unsigned long long)g * nt * levels);
                TH_CHECK(st.blocks == g && st.threads == (uint64_t)g * nt && st.plain_blocks == 0,
                         "stats: %llu blocks, %llu threads, %llu plain", (unsigned long long)st.blocks,
                         (unsigned long long)st.threads, (unsigned long long)st.plain_blocks);
                free(in);
                free(out);
                th_end();
            }
}

static void test_block_sum_dyn(void)
{
    static const unsigned blocks[] = {32, 96, 256, 1024};
    for (unsigned bi = 0; bi < sizeof blocks / sizeof *blocks; bi++) {
        unsigned nt = blocks[bi], g = 5;
        int n = 54321;
        th_begin("emu block_sum_dyn (warp shuffles + dynamic smem) block %u grid %u", nt, g);
        float *in = random_floats(n, 99 + bi), *out = calloc(g, sizeof *out);
        struct block_sum_params p = {in, out, n};
        LAUNCH_OK(EMU_KERNEL(block_sum_dyn), d3(g, 1, 1), d3(nt, 1, 1), nt / 32 * sizeof(float), &p, NULL);
        check_sums(in, n, out, g, nt);
        free(in);
        free(out);
        th_end();
    }
}

static void test_sync_vote(void)
{
    static const char *const names[] = {"random", "all true", "all false"};
    for (int variant = 0; variant < 3; variant++) {
        unsigned nt = 100;
        th_begin("emu __syncthreads_count/and/or, %u threads, %s", nt, names[variant]);
        int pred[100], out[300], count = 0;
        uint64_t seed = 5;
        for (unsigned i = 0; i < nt; i++) {
            pred[i] = variant == 0 ? (int)(test_rand(&seed) % 3) : variant == 1 ? 7 : 0;
            count += pred[i] != 0;
        }
        struct sync_vote_params p = {pred, out};
        LAUNCH_OK(EMU_KERNEL(sync_vote), d3(1, 1, 1), d3(nt, 1, 1), 0, &p, NULL);
        for (unsigned i = 0; i < nt && !th_failed(); i++)
            TH_CHECK(out[3 * i] == count && out[3 * i + 1] == (count == (int)nt) && out[3 * i + 2] == (count > 0),
                     "thread %u saw count %d and %d or %d; want %d %d %d", i, out[3 * i], out[3 * i + 1],
                     out[3 * i + 2], count, count == (int)nt, count > 0);
        th_end();
    }
}

static void test_indices(void)
{
    th_begin("emu built-in indices, grid (3,2,2) block (5,3,2), plain blocks");
    unsigned gx = 3, gy = 2, gz = 2, bx = 5, by = 3, bz = 2, nb = gx * gy * gz, nt = bx * by * bz;
    unsigned *out = calloc((size_t)nb * nt * 8, sizeof *out);
    struct index_params p = {out};
    struct emu_stats st;
    struct emu_options opt = {.shuffle_seed = 0, .stack_size = 0, .stats = &st};
    LAUNCH_OK(EMU_KERNEL(indices), d3(gx, gy, gz), d3(bx, by, bz), 0, &p, &opt);
    unsigned dims = bx + 10 * by + 100 * bz + 1000 * gx + 10000 * gy + 100000 * gz;
    for (unsigned b = 0; b < nb && !th_failed(); b++)
        for (unsigned t = 0; t < nt && !th_failed(); t++) {
            const unsigned *o = out + 8 * (b * nt + t);
            unsigned want[8] = {t % bx, t / bx % by, t / (bx * by), b % gx, b / gx % gy, b / (gx * gy), t, dims};
            TH_CHECK(!memcmp(o, want, sizeof want), "block %u thread %u: got %u %u %u / %u %u %u / %u / %u", b, t,
                     o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]);
        }
    /* Each block: one switch into the fiber that runs every thread plainly, one back. */
    TH_CHECK(st.plain_blocks == nb && st.switches == 2ull * nb, "%llu plain blocks of %u, %llu switches",
             (unsigned long long)st.plain_blocks, nb, (unsigned long long)st.switches);
    free(out);
    th_end();
}

static void test_histogram(void)
{
    th_begin("emu atomics: shared and global histogram, max/min/inc/CAS, float add");
    int n = 10000;
    unsigned g = 4, nt = 128, *in = malloc((size_t)n * sizeof *in), hist[64] = {0}, want[64] = {0};
    unsigned stats[4] = {0, 0xffffffffu, 0, 0}, vmax = 0, vmin = 0xffffffffu;
    float fsum = 0;
    double fwant = 0;
    uint64_t seed = 77;
    for (int i = 0; i < n; i++) {
        in[i] = test_rand(&seed) % 100000;
        want[in[i] % 64]++;
        vmax = in[i] > vmax ? in[i] : vmax;
        vmin = in[i] < vmin ? in[i] : vmin;
        fwant += in[i] % 64;
    }
    struct histogram_params p = {in, hist, stats, &fsum, n};
    LAUNCH_OK(EMU_KERNEL(histogram), d3(g, 1, 1), d3(nt, 1, 1), 0, &p, NULL);
    TH_CHECK(!memcmp(hist, want, sizeof want), "histogram differs");
    TH_CHECK(stats[0] == vmax && stats[1] == vmin, "max %u min %u, want %u %u", stats[0], stats[1], vmax, vmin);
    TH_CHECK(stats[2] == g * nt, "atomicInc counted %u, want %u", stats[2], g * nt);
    TH_CHECK(stats[3] == g, "atomicCAS: %u winners, want one per block (%u)", stats[3], g);
    TH_CHECK(fsum == (float)fwant, "float atomicAdd %.1f, want %.1f", fsum, fwant);
    free(in);
    th_end();
}

static void test_handoff(void)
{
    th_begin("emu shared memory written by one thread is what every thread reads after the barrier");
    int out[96];
    struct handoff_params p = {out};
    LAUNCH_OK(EMU_KERNEL(smem_handoff), d3(2, 1, 1), d3(96, 1, 1), 0, &p, NULL);
    for (unsigned t = 0; t < 96; t++) TH_CHECK(out[t] == 12, "thread %u read %d, want 12", t, out[t]);
    th_end();
}

static void test_shuffled_race_free(void)
{
    th_begin("emu shuffled mode: a race-free kernel gives the same bits for every seed");
    int n = 4321;
    unsigned g = 6, nt = 256;
    float *in = random_floats(n, 3), ref[6], out[6];
    struct block_sum_params p = {in, ref, n};
    LAUNCH_OK(EMU_KERNEL(block_sum), d3(g, 1, 1), d3(nt, 1, 1), 0, &p, NULL);
    p.out = out;
    for (uint64_t seed = 1; seed <= 8 && !th_failed(); seed++) {
        struct emu_options opt = {.shuffle_seed = seed, .stack_size = 0, .stats = NULL};
        LAUNCH_OK(EMU_KERNEL(block_sum), d3(g, 1, 1), d3(nt, 1, 1), 0, &p, &opt);
        TH_CHECK(!memcmp(out, ref, sizeof ref), "seed %llu changed the result", (unsigned long long)seed);
        LAUNCH_OK(EMU_KERNEL(block_sum_dyn), d3(g, 1, 1), d3(nt, 1, 1), nt / 32 * sizeof(float), &p, &opt);
        check_sums(in, n, out, g, nt);
    }
    free(in);
    th_end();
}

static void expect_config_error(const char *what, emu_dim3 grid, emu_dim3 block, size_t smem, size_t psize)
{
    th_begin("emu refuses %s", what);
    float in = 1, out[2];
    struct block_sum_params p = {&in, out, 1};
    struct emu_error e;
    emu_status s = emu_launch(EMU_KERNEL(block_sum), grid, block, smem, &p, psize, NULL, &e);
    TH_CHECK(s == EMU_ERR_CONFIG && e.code == s, "status %s, want %s", emu_status_str(s),
             emu_status_str(EMU_ERR_CONFIG));
    TH_CHECK(strstr(e.msg, "block_sum") != NULL, "message does not name the kernel: %s", e.msg);
    th_end();
}

static void test_config_errors(void)
{
    size_t ps = sizeof(struct block_sum_params);
    expect_config_error("an empty block", d3(1, 1, 1), d3(0, 1, 1), 0, ps);
    expect_config_error("1025 threads", d3(1, 1, 1), d3(1025, 1, 1), 0, ps);
    expect_config_error("blockDim.z 65", d3(1, 1, 1), d3(1, 1, 65), 0, ps);
    expect_config_error("gridDim.y 65536", d3(1, 65536, 1), d3(32, 1, 1), 0, ps);
    expect_config_error("the wrong parameter size", d3(1, 1, 1), d3(32, 1, 1), 0, ps - 4);
    expect_config_error("too much dynamic shared memory", d3(1, 1, 1), d3(32, 1, 1), EMU_MAX_DYN_SMEM + 1, ps);
    expect_config_error("gridDim.z 65536", d3(1, 1, 65536), d3(32, 1, 1), 0, ps);
    expect_config_error("gridDim.x 2^31", d3(0x80000000u, 1, 1), d3(32, 1, 1), 0, ps);
}

/* One launch of block_sum_dyn (which needs 4 bytes of dynamic shared memory a warp; block_sum when smem is 0) with
 * the kernel attributes a and the device's opt-in shared memory; want: the status; needle: what the message must
 * say. */
static void limit_case(const char *what, emu_dim3 block, size_t smem, struct emu_func_attrs a, unsigned optin,
                       emu_status want, const char *needle)
{
    th_begin("emu hardware limit: %s: %s", what, want == EMU_OK ? "runs" : "refused");
    float in[3] = {1, 2, 3}, out[1] = {0};
    struct block_sum_params p = {in, out, 3};
    struct emu_options opt = {.attrs = &a, .smem_optin = optin};
    struct emu_error e;
    const struct emu_kernel *k = smem ? EMU_KERNEL(block_sum_dyn) : EMU_KERNEL(block_sum);
    emu_status s = emu_launch(k, d3(1, 1, 1), block, smem, &p, sizeof p, &opt, &e);
    TH_CHECK(s == want && e.code == s, "status %s (%s), want %s", emu_status_str(s), e.msg, emu_status_str(want));
    if (want == EMU_OK)
        TH_CHECK(out[0] == 6.0f, "sum %g", out[0]);
    else
        TH_CHECK(strstr(e.msg, k->name) && strstr(e.msg, needle), "message: %s (want the kernel and '%s')", e.msg,
                 needle);
    th_end();
}

/* What the driver refuses although the code is fine: shared memory beyond the static limit, the default dynamic
 * limit, the attribute and the device's opt-in maximum; registers beyond 65536 a block (allocated 256 a warp). */
static void test_hardware_limits(void)
{
    const unsigned K = 1024, s80 = EMU_SMEM_OPTIN_SM80;
    const struct emu_func_attrs plain = {0, 0, 0};
    limit_case("48 KiB dynamic, attribute not set", d3(64, 1, 1), 48 * K, plain, 0, EMU_OK, "");
    limit_case("48 KiB + 1 dynamic, attribute not set", d3(64, 1, 1), 48 * K + 1, plain, 0, EMU_ERR_CONFIG,
               "more than its maximum of 49152");
    limit_case("1 KiB static + 47 KiB dynamic", d3(64, 1, 1), 47 * K, (struct emu_func_attrs){0, K, 0}, 0, EMU_OK, "");
    limit_case("1 KiB static + 47 KiB + 1 dynamic", d3(64, 1, 1), 47 * K + 1, (struct emu_func_attrs){0, K, 0}, 0,
               EMU_ERR_CONFIG, "more than its maximum of 48128");
    limit_case("48 KiB static", d3(64, 1, 1), 0, (struct emu_func_attrs){0, 48 * K, 0}, 0, EMU_OK, "");
    limit_case("48 KiB + 1 static", d3(64, 1, 1), 0, (struct emu_func_attrs){0, 48 * K + 1, 0}, 0, EMU_ERR_CONFIG,
               "49153 bytes of static shared memory");
    limit_case("100 KiB dynamic with the attribute at 100 KiB", d3(64, 1, 1), 100 * K,
               (struct emu_func_attrs){0, 0, 100 * K}, 0, EMU_OK, "");
    limit_case("100 KiB + 1 dynamic with the attribute at 100 KiB", d3(64, 1, 1), 100 * K + 1,
               (struct emu_func_attrs){0, 0, 100 * K}, 0, EMU_ERR_CONFIG, "MAX_DYNAMIC_SHARED_SIZE_BYTES");
    limit_case("227 KiB dynamic on sm_90", d3(64, 1, 1), 227 * K, (struct emu_func_attrs){0, 0, 227 * K}, 0, EMU_OK,
               "");
    limit_case("163 KiB dynamic on sm_80", d3(64, 1, 1), 163 * K, (struct emu_func_attrs){0, 0, 163 * K}, s80, EMU_OK,
               "");
    limit_case("1 KiB static + 163 KiB dynamic on sm_80", d3(64, 1, 1), 163 * K,
               (struct emu_func_attrs){0, K, 200 * K}, s80, EMU_ERR_CONFIG, "more than the device's 166912");
    limit_case("64 registers x 1024 threads", d3(1024, 1, 1), 128, (struct emu_func_attrs){64, 0, 0}, 0, EMU_OK, "");
    limit_case("65 registers x 1024 threads", d3(1024, 1, 1), 128, (struct emu_func_attrs){65, 0, 0}, 0,
               EMU_ERR_RESOURCES, "65 registers a thread x 1024 threads");
    limit_case("255 registers x 256 threads", d3(256, 1, 1), 32, (struct emu_func_attrs){255, 0, 0}, 0, EMU_OK, "");
    limit_case("255 registers x 257 threads", d3(257, 1, 1), 64, (struct emu_func_attrs){255, 0, 0}, 0,
               EMU_ERR_RESOURCES, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES");
    limit_case("129 registers x (16,8,4) threads", d3(16, 8, 4), 64, (struct emu_func_attrs){129, 0, 0}, 0,
               EMU_ERR_RESOURCES, "x 512 threads");
}

static void test_reuse(void)
{
    th_begin("emu launches after emu_release and with a custom stack size");
    float in[64], out[1];
    for (int i = 0; i < 64; i++) in[i] = (float)i;
    struct block_sum_params p = {in, out, 64};
    emu_release();
    struct emu_options opt = {.shuffle_seed = 0, .stack_size = 16 * 1024 * 1024, .stats = NULL};
    LAUNCH_OK(EMU_KERNEL(block_sum), d3(1, 1, 1), d3(64, 1, 1), 0, &p, &opt);
    TH_CHECK(out[0] == 2016.0f, "sum %g", out[0]);
    LAUNCH_OK(EMU_KERNEL(block_sum), d3(1, 1, 1), d3(64, 1, 1), 0, &p, NULL);
    TH_CHECK(out[0] == 2016.0f, "sum %g", out[0]);
    th_end();
}

int main(void)
{
    test_block_sum();
    test_block_sum_dyn();
    test_sync_vote();
    test_indices();
    test_histogram();
    test_handoff();
    test_shuffled_race_free();
    test_config_errors();
    test_hardware_limits();
    test_reuse();
    emu_release();
    return th_summary();
}
