/* The cpu backend's decode tiles (layout/tiles.h, docs/cpu.md "Spans and tiles"): the tiles a decode step really
 * cuts (rt_step_tiles on the cpu backend: the same iterator the step runs) are the plan's (128 tokens over KIVI's
 * key page runs, kvq_tile_len), where the reference storage's separate pages cut them to 32 before; the step's
 * outputs are compared with the reference backend on the same inputs. Without LLVM: SKIP. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "test_step_tiles.h"

/* KIVI-2 (R = 128, G = 32), a prefill of 1000 tokens, then `steps` decode steps; the tiles of kv head 0 after the
 * last one, as "tokens/key pages" (the cuda backend's list, test_cuda_tiles, up to its fp16 tiles, which its
 * shared memory caps at 16 or 32 rows: the cpu backend's fp16 tiles are the plan's 128 too).
 * With one thread the step runs two KV chunks past 1024 tokens; their edge falls on a tile boundary (640).
 * One step: keys 0..895 one flush (a page run of 28 pages), values 0..871 one page, token 872's value in an
 * appendable page (ending at 896), then the windows: six tiles of 128 (4 key pages each), 104 (cut by the value
 * page's end), 1 (the append page), 23 (to the key page's end, against the value window), the key window from
 * 896 (105 tokens) against the rest of the value window.
 * 300 steps: key runs [896, 1024), [1024, 1152), [1152, 1280); value pages [872, 896), [896, 1024),
 * [1024, 1152), [1152, 1172); the last key run is cut by the value page's end (20), then to its page's end (12),
 * then 96 tokens (3 pages) against the value window; then the key window (20) against the value window's rest. */
static const step_case step_cases[] = {
    {1, 2, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 23/1 105/1", 0},
    {1, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 23/1 105/1", 0},
    {300, 2, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 24/1 128/4 128/4 20/1 12/1 96/3 20/1", 0},
    {300, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 24/1 128/4 128/4 20/1 12/1 96/3 20/1", 0},
};

/* Every tile is the rule's: at most the plan's tile, and a tile of several key pages at most 128 tokens. */
static void cpu_extra(kvq_engine *be, kvq_seq *sb, kvq_engine *ref, kvq_seq *sr, const kvq_tile_info *t, int n)
{
    (void)be, (void)sb, (void)ref, (void)sr;
    for (int i = 0; i < n; i++) TH_CHECK(t[i].n <= 128 && t[i].k_pages <= kvq_tile_max_pages(128, 32), "tile %d", i);
}

static void test_step(const step_case *sc)
{
    th_begin("kivi2 on the cpu backend, GQA %d, 1000 tokens + %d decode steps: the tiles a step cuts are the rule's "
             "(the plan's 128 tokens over KIVI's key page runs), outputs within 1e-3 of the reference",
             sc->heads / 2, sc->steps);
    st_run(sc, KVQ_BACKEND_CPU, cpu_extra);
}

int main(void)
{
    /* GQA 1: the int8 key and value paths (on a VNNI host); GQA 4: the fp32 paths */
    for (size_t i = 0; i < sizeof step_cases / sizeof step_cases[0]; i++) test_step(&step_cases[i]);
    return th_summary();
}
