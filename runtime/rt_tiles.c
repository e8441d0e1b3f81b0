/* rt_step_tiles: what a decode step's tiles were (rt_internal.h; docs/layout.md "Tiles"). */
#include "rt_internal.h"

kvq_status rt_step_tiles(kvq_engine *e, const kvq_seq *s, int layer, kvq_tile_info *out, int cap, int *n)
{
    if (!e) return KVQ_ERR_INVALID;
    if (!s || !n || cap < 0 || (cap > 0 && !out))
        return rt_error(e, KVQ_ERR_INVALID, "rt_step_tiles: a NULL argument or a negative capacity");
    if (s->engine != e) return rt_error(e, KVQ_ERR_INVALID, "rt_step_tiles: the sequence is not of this engine");
    if (layer < 0 || layer >= e->bee.dims.layers)
        return rt_error(e, KVQ_ERR_INVALID, "rt_step_tiles: layer %d is out of range (the engine has %d)", layer,
                        e->bee.dims.layers);
    if (!s->prefilled[layer])
        return rt_error(e, KVQ_ERR_INVALID, "rt_step_tiles: layer %d of the sequence is not prefilled", layer);
    if (!e->be->step_tiles)
        return rt_error(e, KVQ_ERR_UNSUPPORTED, "rt_step_tiles: the %s backend has no tile lists", e->be->name);
    char msg[256] = "";
    kvq_status st = e->be->step_tiles(e->ctx, s->bseq, layer, out, cap, n, msg, sizeof msg);
    if (st != KVQ_OK) return rt_error(e, st, "rt_step_tiles: %s", msg);
    return KVQ_OK;
}
