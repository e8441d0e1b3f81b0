/* kvqc build --cost: executed warp-instructions of the decode kernels over a real emulated decode step
 * (tools/kvqc/cost.c; docs/cuda.md, "Cost model"). */
#ifndef KVQC_COST_H
#define KVQC_COST_H

#include "emit_cuda.h"
#include "kvq.h"
#include "plan.h"

typedef struct {
    int batch, tokens; /* the workload: sequences and prefilled tokens each (the step adds one) */
    int every_block;   /* run every sequence's prefill and every block of the step (no sampling: the check of it) */
} kvqc_cost_args;

/* The header lines of the cost table. */
void kvqc_cost_header(const kvqc_cost_args *a, emit_buf *out);

/* Appends a row per decode kernel of `p` for `arch` to out: `src` is the unit built, `dir` holds <arch>.cubin,
 * `nvdisasm` the tool. 0 ok, -1 failed (reported on stderr). */
int kvqc_cost(const kvqc_cost_args *a, const kvq_scheme *sch, const kvq_plan *p, const char *dir, const char *src,
              const char *arch, const char *nvdisasm, emit_buf *out);

#endif
