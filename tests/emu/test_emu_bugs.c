/* Emulator: what it catches. A shared-memory race shows up as results that change with the shuffle seed;
 * divergent barriers, threads that exit while others wait, misused warp collectives, a misaligned cp.async and
 * __trap() come back as statuses with messages naming the kernel, the block and the threads, never as a hang
 * (an alarm turns a hang into a failure). After each failed launch the next one works. */
#include <stdlib.h>
#include <unistd.h>

#include "emu_test.h"
#include "params.h"

EMU_KERNEL_DECLARE(bug);

enum { OK, RACE, TWO_BARRIERS, EXIT_EARLY, LOOP_TRIPS, NOT_IN_MASK, MISSING_LANES, LANE_EXITED, DISAGREE, TRAP,
       MISALIGNED, BAR_VS_WARP, OUTSIDE_MASK, BAD_WIDTH, LATE_BLOCK, MMA_PARTIAL, MMA_HALF };

static int out[4 * 1024];

static emu_status run(int mode, unsigned grid, unsigned block, uint64_t seed, struct emu_error *e)
{
    memset(out, 0, sizeof out);
    struct bug_params p = {out, mode};
    struct emu_options opt = {.shuffle_seed = seed, .stack_size = 0, .stats = NULL};
    return emu_launch(EMU_KERNEL(bug), d3(grid, 1, 1), d3(block, 1, 1), 0, &p, sizeof p, &opt, e);
}

/* The correct kernel still works (fibers abandoned by the failure are reusable). */
static void check_recovered(void)
{
    struct emu_error e;
    emu_status s = run(OK, 2, 64, 0, &e);
    TH_CHECK(s == EMU_OK, "next launch failed: %s", e.msg);
    for (unsigned t = 0; t < 64 && s == EMU_OK; t++)
        TH_CHECK(out[t] == (int)(t * 7 + 1 + ((t + 1) % 64) * 7 + 1), "next launch: thread %u got %d", t, out[t]);
}

static void expect_error(const char *what, int mode, unsigned grid, unsigned block, emu_status want,
                         const char *const *needles)
{
    th_begin("emu reports %s", what);
    struct emu_error e;
    emu_status s = run(mode, grid, block, 0, &e);
    TH_CHECK(s == want && e.code == want, "status %s, want %s (%s)", emu_status_str(s), emu_status_str(want), e.msg);
    for (; *needles; needles++) TH_CHECK(strstr(e.msg, *needles) != NULL, "message lacks \"%s\": %s", *needles, e.msg);
    check_recovered();
    th_end();
}

static void test_race(void)
{
    th_begin("emu shuffled mode exposes a shared-memory race (and not the same kernel with its barrier)");
    int ref[256], differs = 0;
    struct emu_error e;
    TH_CHECK(run(RACE, 1, 256, 0, &e) == EMU_OK, "%s", e.msg);
    memcpy(ref, out, sizeof ref);
    for (uint64_t seed = 1; seed <= 4; seed++) {
        TH_CHECK(run(RACE, 1, 256, seed, &e) == EMU_OK, "%s", e.msg);
        differs += memcmp(ref, out, sizeof ref) != 0;
    }
    TH_CHECK(differs == 4, "only %d of 4 seeds changed the racy kernel's result", differs);
    TH_CHECK(run(OK, 1, 256, 0, &e) == EMU_OK, "%s", e.msg);
    memcpy(ref, out, sizeof ref);
    for (uint64_t seed = 1; seed <= 4; seed++) {
        TH_CHECK(run(OK, 1, 256, seed, &e) == EMU_OK, "%s", e.msg);
        TH_CHECK(!memcmp(ref, out, sizeof ref), "seed %llu changed the race-free kernel", (unsigned long long)seed);
    }
    th_end();
}

static void test_outside_mask(void)
{
    th_begin("emu gives all-ones bits to a shuffle reading outside its mask");
    struct emu_error e;
    TH_CHECK(run(OUTSIDE_MASK, 1, 32, 0, &e) == EMU_OK, "%s", e.msg);
    for (unsigned t = 0; t < 16; t++) TH_CHECK(out[t] == -1, "lane %u got %d", t, out[t]);
    th_end();
}

int main(void)
{
    alarm(60); /* a hang is a failure, not a stuck test run */
    test_race();
    test_outside_mask();
    expect_error("two __syncthreads met by different warps", TWO_BARRIERS, 1, 64, EMU_ERR_BARRIER,
                 (const char *const[]){"kernel 'bug'", "block (0,0,0)", "divergent barrier", "threads 0-31 waiting at",
                                       "threads 32-63 waiting at", "bugs.cu", NULL});
    expect_error("divergence in a later block, by its index", LATE_BLOCK, 3, 64, EMU_ERR_BARRIER,
                 (const char *const[]){"block (1,0,0)", "divergent barrier", NULL});
    expect_error("a thread that exits while the others wait", EXIT_EARLY, 1, 64, EMU_ERR_BARRIER,
                 (const char *const[]){"barrier never completes", "threads 0-4,6-63 waiting at", "thread 5 exited", NULL});
    expect_error("a barrier in a loop with per-thread trip counts", LOOP_TRIPS, 1, 9, EMU_ERR_BARRIER,
                 (const char *const[]){"barrier never completes", "exited", NULL});
    expect_error("a shuffle mask without the caller", NOT_IN_MASK, 1, 32, EMU_ERR_WARP,
                 (const char *const[]){"__shfl_sync", "does not include the calling lane", "thread 1 ", NULL});
    expect_error("a full mask in a partial warp", MISSING_LANES, 1, 48, EMU_ERR_WARP,
                 (const char *const[]){"__shfl_xor_sync", "names lanes 16-31, which warp 1 of the block lacks", NULL});
    expect_error("a shuffle waiting for a lane that exited", LANE_EXITED, 1, 32, EMU_ERR_BARRIER,
                 (const char *const[]){"lane 3 of warp 0, which exited", NULL});
    expect_error("lanes of one mask at different collectives", DISAGREE, 1, 32, EMU_ERR_WARP,
                 (const char *const[]){"__ballot_sync", "__shfl_sync", NULL});
    expect_error("__trap()", TRAP, 4, 32, EMU_ERR_TRAP,
                 (const char *const[]){"block (2,0,0) thread 7", "__trap()", NULL});
    expect_error("a misaligned cp.async", MISALIGNED, 1, 32, EMU_ERR_ASYNC,
                 (const char *const[]){"cp.async", "not 16-byte aligned", NULL});
    expect_error("half a warp at __syncthreads, half at __syncwarp", BAR_VS_WARP, 1, 32, EMU_ERR_BARRIER,
                 (const char *const[]){"threads 0-15 waiting at", "(__syncthreads)", "threads 16-31 waiting at",
                                       "(__syncwarp, mask 0xffffffff)", NULL});
    expect_error("a shuffle width that is not a power of 2", BAD_WIDTH, 1, 32, EMU_ERR_WARP,
                 (const char *const[]){"width 3", NULL});
    expect_error("mma.sync in a partial warp", MMA_PARTIAL, 1, 48, EMU_ERR_WARP,
                 (const char *const[]){"mma.sync.m16n8k16", "names lanes 16-31, which warp 1 of the block lacks", NULL});
    expect_error("half a warp at mma.sync, half at a shuffle", MMA_HALF, 1, 32, EMU_ERR_WARP,
                 (const char *const[]){"mma.sync.m16n8k16", "__shfl_sync", NULL});
    emu_release();
    return th_summary();
}
