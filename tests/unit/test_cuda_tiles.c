/* Decode tiles (layout/tiles.h, docs/layout.md "Tiles"): the one tile rule, and the tiles the runtime really
 * produces in a decode step (rt_step_tiles on the emu backend). KIVI writes a flush of R keys as R / G
 * per-channel pages of one group; as a page run they give tiles of the plan's 128 tokens, where pages cut them to
 * 32 before. The step's outputs are compared with the reference backend on the same inputs. Without the
 * emulator: SKIP. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "plan.h"
#include "test_step_tiles.h"

static void test_rule(void)
{
    th_begin("tile rule: at most the tile, what is left of both runs, a tile begun inside a run's page ends with it");
    TH_CHECK(kvq_tile_len(128, 896, 872, 0, 32) == 128, "%d", kvq_tile_len(128, 896, 872, 0, 32));
    TH_CHECK(kvq_tile_len(128, 128, 104, 768, 32) == 104, "cut by the values");
    TH_CHECK(kvq_tile_len(128, 24, 129, 872, 32) == 24, "begun at slot 8 of a page: to the page's end");
    TH_CHECK(kvq_tile_len(128, 100, 100, 20, 32) == 12, "%d", kvq_tile_len(128, 100, 100, 20, 32));
    TH_CHECK(kvq_tile_len(128, 100, 100, 20, 0) == 100, "not a page run: no page rule");
    TH_CHECK(kvq_tile_pages(128, 0, 32) == 4 && kvq_tile_pages(104, 768, 32) == 4 && kvq_tile_pages(1, 872, 32) == 1,
             "pages spanned");
    TH_CHECK(kvq_tile_pages(40, 3, 0) == 1, "a single container");
    TH_CHECK(kvq_tile_max_pages(128, 32) == 4 && kvq_tile_max_pages(128, 48) == 3 && kvq_tile_max_pages(128, 8) == 1 &&
                 kvq_tile_max_pages(128, 128) == 1 && kvq_tile_max_pages(128, 0) == 1,
             "most pages a tile spans");
    kvq_page_format f;
    kvq_tensor_cfg t;
    memset(&t, 0, sizeof t);
    t.bits = 2, t.gran = KVQ_GRAN_CHANNEL, t.group = 32, t.scale_dtype = t.zero_dtype = KVQ_DT_FP16;
    kvq_page_format_init(&f, &t, 2, 0, 8, 128, 32);
    TH_CHECK(kvq_page_run_ok(&f), "KIVI-2 key pages form runs");
    kvq_page_format_init(&f, &t, 2, 0, 8, 128, 5);
    TH_CHECK(!kvq_page_run_ok(&f), "a short last page does not");
    t.gran = KVQ_GRAN_TOKEN;
    kvq_page_format_init(&f, &t, 2, 0, 8, 128, 32);
    TH_CHECK(!kvq_page_run_ok(&f), "per-token pages do not");
    TH_CHECK(kvq_page_run_stride(12288) == 12288 && kvq_page_run_stride(12289) == 12544, "stride");
    th_end();
}

/* KIVI-2 (R = 128, G = 32), a prefill of 1000 tokens, then `steps` decode steps; the tiles of the last one, as
 * "tokens/key pages". The plan's tile is 256 tokens (8 key pages: 3 CTAs an sm_90 SM at its shared memory,
 * plan.c); fp16 rows (the windows) take at most plan_tile_tokens(class, 1, 1) tokens: 32 at GQA 2 and 4 (each
 * stage of the load pipeline has rows for 256 2-bit tokens: 32 fp16 ones, docs/cuda.md "Shared memory").
 *
 * One step: keys 0..895 one flush (a page run of 28 pages), values 0..871 one page, then token 872's value in an
 * appendable page (aligned: it ends at 896), then the windows: three tiles of 256 (8 key pages each), 104 (cut by
 * the value page's end), 1 (the append page), 23 (to the key page's end, against the value window), then the
 * windows from 896 (105 tokens) in fp16 tiles: 32, 32, 32, 9.
 * 300 steps: key flushes of 4 pages at 1024, 1152, 1280 (each its own run: 128 tokens at most); value pages
 * [872, 896), [896, 1024), [1024, 1152), [1152, 1172) of 128 (aligned to the key flushes), the windows from 1280
 * (keys) and 1172 (values); the last key run [1152, 1280) is cut by the value page's end (20), to its page's end
 * (12), then against the value window in fp16 tiles (32, 32 to 1248, cut where its ring wraps at 1259, then 21 to
 * the key pages' end at 1280, where a tile began inside one); then the windows (20).
 * $KVQ_DECODE_TILE=128 (docs/cuda.md "Tuning knobs"): the same cuts with tiles of up to 128 tokens (4 key pages)
 * and fp16 tiles of 16 (each stage has rows for 16 fp16 tokens). GQA 2 and 4: q.K on tensor cores, four 16-token
 * blocks a warp at 256 (GQA 2 with half of N's columns, since 2026-11-27; the fp32 path before). */
static const step_case step_cases[] = {
    {1, 4, " 256/8 256/8 256/8 104/4 1/1 23/1 32/1 32/1 32/1 9/1", 0},
    {1, 8, " 256/8 256/8 256/8 104/4 1/1 23/1 32/1 32/1 32/1 9/1", 0},
    {300, 4, " 256/8 256/8 256/8 104/4 24/1 128/4 128/4 20/1 12/1 32/1 32/1 11/1 21/1 20/1", 0},
    {300, 8, " 256/8 256/8 256/8 104/4 24/1 128/4 128/4 20/1 12/1 32/1 32/1 11/1 21/1 20/1", 0},
    {1, 8, " 128/4 128/4 128/4 128/4 128/4 128/4 104/4 1/1 16/1 7/1 16/1 16/1 16/1 16/1 16/1 16/1 9/1", 128},
};

/* The reference keeps no tile lists, and a layer out of range is refused. */
static void emu_extra(kvq_engine *be, kvq_seq *sb, kvq_engine *ref, kvq_seq *sr, const kvq_tile_info *t, int n)
{
    (void)t;
    kvq_tile_info u[64];
    TH_CHECK(rt_step_tiles(ref, sr, 0, u, 64, &n) == KVQ_ERR_UNSUPPORTED, "the reference has no tile lists");
    TH_CHECK(rt_step_tiles(be, sb, 1, u, 64, &n) == KVQ_ERR_INVALID, "layer out of range");
}

static void test_step(const step_case *sc)
{
    th_begin("kivi2 on the emu backend, GQA %d, 1000 tokens + %d decode steps: the tiles the last step read are the "
             "rule's (%d-token tiles over KIVI's key page runs and aligned value pages), outputs within 1e-3 of the "
             "reference", sc->heads / 2, sc->steps, sc->tile ? sc->tile : 256);
    char v[16];
    snprintf(v, sizeof v, "%d", sc->tile);
    if (sc->tile) setenv("KVQ_DECODE_TILE", v, 1); /* read when the engine's plan is built */
    st_run(sc, KVQ_BACKEND_EMU, emu_extra);
    unsetenv("KVQ_DECODE_TILE");
}

int main(void)
{
    unsetenv("KVQ_DECODE_TILE");
    test_rule();
    /* GQA 2 and 4, both on the tensor cores (GQA 2: half of N's columns); the 128-token knob at GQA 4 only (the
     * tile lists do not depend on the GQA) */
    for (size_t i = 0; i < sizeof step_cases / sizeof step_cases[0]; i++) test_step(&step_cases[i]);
    return th_summary();
}
