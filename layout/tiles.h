/* Decode tiles: the one rule by which the backends cut a layer's storage into tiles and kvqc counts them
 * (DESIGN §5, docs/layout.md "Tiles").
 *
 * A tile is the unit a decode kernel stages and pays its fixed costs for (descriptor, staging set-up, barriers,
 * the softmax maximum and rescale): a run of at most `tile` tokens (the plan's) whose keys lie at consecutive
 * slots of one key run and whose values at consecutive slots of one value run. A run is a container's slots in
 * order: fp16 rows (sinks, window ring runs, pools), one page, or a *page run*: the pages of one flush, placed
 * back to back at kvq_page_run_stride, that a tile may span (KIVI writes a flush of R keys as R / G per-channel
 * pages of one group each; as a run they give tiles of the plan's length instead of G). A tile spanning several
 * pages of a run begins at a page boundary, so that every 16-token block of it lies in one page (one group: the
 * tensor-core q.K folds the query once per page). */
#ifndef KVQ_TILES_H
#define KVQ_TILES_H

#include <stddef.h>

#include "layout.h"

/* Pages of a page run start kvq_page_run_stride(total) bytes apart: their total rounded up to 256 bytes (the
 * device pool's block alignment). Kernels compute the same stride from the page format. */
#define KVQ_PAGE_RUN_ALIGN 256
static inline size_t kvq_page_run_stride(size_t total)
{
    return (total + (KVQ_PAGE_RUN_ALIGN - 1)) & ~(size_t)(KVQ_PAGE_RUN_ALIGN - 1);
}

/* Whether full pages of format f may form a page run: quantized per-channel pages of a group (not the whole
 * flush) that is a multiple of 16 tokens. */
int kvq_page_run_ok(const kvq_page_format *f);

/* Tokens of the next tile: at most `tile`, what is left of the key run (k_left) and of the value run (v_left);
 * when the key run is a page run of pages of k_page_cap slots (0: it is not) and the tile begins k_off slots into
 * it, not past the end of the page it begins in unless it begins at a page boundary. */
int kvq_tile_len(int tile, int k_left, int v_left, int k_off, int k_page_cap);

/* Key pages a tile of n tokens at offset k_off of a key run spans (1 unless a page run). */
int kvq_tile_pages(int n, int k_off, int k_page_cap);

/* Most key pages a tile of the plan's `tile` tokens spans in page runs of `group`-token pages (1 if none). */
int kvq_tile_max_pages(int tile, int group);

/* What a decode step read, tile by tile (rt_step_tiles; kvqc's cost model). */
typedef struct {
    int n;       /* tokens */
    int k_kind;  /* KVQ_SRC_F16 = 1 (fp16 rows), KVQ_SRC_HI = 2, KVQ_SRC_LO = 3 (templates/kvq_params.cuh) */
    int v_kind;
    int k_pages; /* key pages the tile spans */
} kvq_tile_info;

#endif
