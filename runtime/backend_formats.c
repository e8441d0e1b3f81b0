/* Which element formats (compiler/scheme_format.h) a backend can run: the reference backend runs every one; a
 * backend whose kernels decode only asymmetric integers refuses the others here, naming the layer, the tensor,
 * the format and itself, instead of computing something else. */
#include <stdio.h>

#include "backend.h"

kvq_status kvq_be_refuse_formats(const kvq_be_engine *e, const char *backend, char *msg, size_t n)
{
    for (int l = 0; l < e->dims.layers; l++) {
        const kvq_layer_cfg *c = kvq_scheme_layer(e->scheme, l);
        if (c->mode == KVQ_MODE_SPARSE) continue;
        for (int which = 0; which < 2; which++) {
            const kvq_tensor_cfg *t = which ? &c->quant.value : &c->quant.key;
            if (kvq_bits_is_fp16(t->bits) || t->format.kind == KVQ_FMT_INT) continue;
            snprintf(msg, n,
                     "layer %d: the %s' element format %s is not supported by the %s backend yet (the reference "
                     "backend runs it)",
                     l, which ? "values" : "keys", kvq_format_name(t->format.kind), backend);
            return KVQ_ERR_UNSUPPORTED;
        }
    }
    return KVQ_OK;
}
