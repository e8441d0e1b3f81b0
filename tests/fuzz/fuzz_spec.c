/* Fuzz target: the spec front end end to end. The input is a .kvq text: parse and check it (every diagnostic
 * formatted), then for every scheme it resolves: the dims check, memory accounting at a few sizes (figures
 * consistent: device bytes = the sum of the device segments, effective bits finite), the kernel plan and the
 * CUDA emission (source, header, manifest). Invariants: no crash, no leak, no sanitizer report; the status
 * agrees with the error count; accounting agrees with kvq_scheme_check_dims and its figures add up. */
#include <math.h>
#include <string.h>

#include "alloc.h"
#include "emit_cuda.h"
#include "fuzz.h"
#include "kvq.h"
#include "plan.h"

const char fuzz_target_name[] = "spec";

static void account(const kvq_scheme *s, const kvq_dims *d, int batch, int seq)
{
    kvq_mem_stats m;
    kvq_status st = kvq_scheme_account(s, d, batch, seq, NULL, &m);
    char msg[512];
    kvq_status cd = kvq_scheme_check_dims(s, d, msg, sizeof msg);
    if (cd != KVQ_OK) {
        FUZZ_CHECK(st == cd, "account %d but check_dims %d (%s)", (int)st, (int)cd, msg);
        return;
    }
    if (st != KVQ_OK) {
        FUZZ_CHECK(st == KVQ_ERR_INVALID && m.device_bytes == 0, "account failed with %d", (int)st);
        return;
    }
    uint64_t dev = 0;
    for (int k = 0; k < KVQ_SEG_COUNT; k++)
        if (k != KVQ_SEG_HOST) dev += m.bytes[k];
    FUZZ_CHECK(dev == m.device_bytes, "device bytes %llu != sum of segments %llu", (unsigned long long)m.device_bytes,
               (unsigned long long)dev);
    FUZZ_CHECK(isfinite(m.effective_bits) && m.effective_bits >= 0, "effective bits %g", m.effective_bits);
}

static void plan_and_emit(const kvq_scheme *s, const kvq_dims *d)
{
    kvq_plan *p = kvq_malloc(sizeof *p);
    if (!p) return;
    char msg[512];
    if (plan_build(s, d, KVQ_F16, p, msg, sizeof msg) == KVQ_OK) {
        emit_cuda_text t;
        if (emit_cuda_text_build(p, NULL, &t) == KVQ_OK) {
            FUZZ_CHECK(t.source && t.source_len == strlen(t.source), "emitted source length");
            emit_cuda_text_free(&t);
        }
    }
    kvq_free(p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvq_spec *spec = NULL;
    kvq_status st = kvq_spec_parse_string("<fuzz>", (const char *)data, size, &spec);
    if (!spec) {
        FUZZ_CHECK(st == KVQ_ERR_NOMEM, "no spec with status %d", (int)st);
        return 0;
    }
    char buf[1024];
    for (int i = 0; i < kvq_spec_diag_count(spec); i++) kvq_diag_format(kvq_spec_diag(spec, i), buf, sizeof buf);
    FUZZ_CHECK((st == KVQ_OK) == (kvq_spec_error_count(spec) == 0) || st == KVQ_ERR_IO,
               "status %d with %d errors", (int)st, kvq_spec_error_count(spec));
    if (st == KVQ_OK) {
        for (int i = 0; i < kvq_spec_scheme_count(spec); i++) {
            const kvq_scheme *s = kvq_spec_scheme_at(spec, i);
            kvq_dims dims[3] = {{2, 4, 2, 64}, {32, 32, 8, 128}, {4096, 4096, 4096, 256}};
            for (int k = 0; k < 3; k++) {
                account(s, &dims[k], 1, 0);
                account(s, &dims[k], 3, 1000);
                account(s, &dims[k], 1 << 20, 1 << 30);
            }
            kvq_dims pd = {0, 0, 0, 0};
            plan_default_dims(s, &pd);
            if (pd.layers <= 64) plan_and_emit(s, &pd); /* emission is per layer class; keep an input fast */
        }
    }
    kvq_spec_free(spec);
    return 0;
}
