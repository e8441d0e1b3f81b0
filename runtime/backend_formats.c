/* Which element formats (compiler/scheme_format.h) a backend can run: the reference and cpu backends run every
 * one; a backend whose kernels decode only asymmetric integers (CUDA today) refuses the others here, naming the
 * layer, the tensor, the format and itself, instead of computing something else (plan_refuse_formats). */
#include "backend.h"
#include "plan.h"

kvq_status kvq_be_refuse_formats(const kvq_be_engine *e, const char *backend, char *msg, size_t n)
{
    return plan_refuse_formats(e->scheme, e->dims.layers, backend, msg, n);
}
