/* The tile rule: see tiles.h and docs/layout.md "Tiles". */
#include "tiles.h"

int kvq_page_run_ok(const kvq_page_format *f)
{
    return !kvq_bits_is_fp16(f->bits) && f->gran == KVQ_GRAN_CHANNEL && f->group > 0 && f->group % 16 == 0 &&
           f->capacity == f->group && !f->channel_separable;
}

int kvq_tile_len(int tile, int k_left, int v_left, int k_off, int k_page_cap)
{
    int n = tile < k_left ? tile : k_left;
    if (v_left < n) n = v_left;
    if (k_page_cap > 0 && k_off % k_page_cap != 0) {
        int rest = k_page_cap - k_off % k_page_cap; /* a tile that begins inside a page ends with it */
        if (rest < n) n = rest;
    }
    return n;
}

int kvq_tile_pages(int n, int k_off, int k_page_cap)
{
    if (k_page_cap <= 0 || n <= 0) return 1;
    return (k_off + n - 1) / k_page_cap - k_off / k_page_cap + 1;
}

int kvq_tile_max_pages(int tile, int group)
{
    if (group <= 0 || group % 16 != 0 || group >= tile) return 1;
    return (tile + group - 1) / group;
}
