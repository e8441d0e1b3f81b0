/* Issue 9, defect 3: every spec the language accepts either compiles for sm_80 and sm_90 or is refused by the
 * plan's target check (kvqc check --target cuda) with the reason. A deterministic sample of bits x granularity x
 * group x head_dim x GQA (each case compiled with NVRTC for one arch, alternating, so the sweep runs in a few
 * minutes on two cores), plus the case that used to need more than 48 KiB of static shared memory (per token,
 * group 8, head_dim 128) and three on the tensor-core paths (GQA 4). A case must either compile with its decode kernel's shared memory all dynamic and
 * within the arch's opt-in limit, or be refused with a message. Skips without libnvrtc. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "cuda/cu.h"
#include "emit_cuda.h"
#include "harness.h"
#include "kvq.h"
#include "plan.h"

typedef struct {
    int kbits, vbits, kchan, vhidden, group, D, heads, kv_heads, residual;
} sweep_case;

static unsigned rng = 12345u;
static unsigned next(void) { return rng = rng * 1103515245u + 12345u, (rng >> 16) & 0x7fff; }

static void spec_text(const sweep_case *c, char *out, size_t n)
{
    char key[96], val[96];
    if (c->kchan)
        snprintf(key, sizeof key, "bits %d; per channel; group %d;", c->kbits, c->group);
    else
        snprintf(key, sizeof key, "bits %d; per token; group %d;", c->kbits, c->group);
    if (c->vhidden)
        snprintf(val, sizeof val, "bits %d; per token; group hidden;", c->vbits);
    else
        snprintf(val, sizeof val, "bits %d; per token; group %d;", c->vbits, c->group);
    snprintf(out, n, "scheme s { key { %s } value { %s } residual %d; }\n", key, val, c->residual);
}

int main(void)
{
    char why[512];
    if (cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        printf("SKIP cuda sweep: %s\n", why);
        return 0;
    }
    static const int bits[] = {1, 2, 3, 4, 8}, groups[] = {8, 16, 32, 64}, Ds[] = {64, 96, 128, 256},
                     gqas[] = {1, 2, 4, 8};
    enum { N = 17 };
    sweep_case cases[N];
    /* the case first, then a large one, then a deterministic sample */
    cases[0] = (sweep_case){2, 2, 0, 0, 8, 128, 32, 8, 32};
    cases[1] = (sweep_case){4, 8, 0, 0, 8, 256, 64, 8, 64};
    for (int i = 2; i < N - 3; i++) {
        sweep_case *c = &cases[i];
        c->kbits = bits[next() % 5], c->vbits = bits[next() % 5];
        c->kchan = next() % 2, c->vhidden = next() % 3 == 0;
        c->D = Ds[next() % 4];
        c->group = groups[next() % 4];
        while (c->D % c->group) c->group /= 2;
        int g = gqas[next() % 4];
        c->kv_heads = 1 + next() % 4;
        c->heads = c->kv_heads * g;
        c->residual = c->kchan ? c->group * (1 + (int)(next() % 4)) : 32;
    }
    /* the tensor-core paths (GQA 4, per-channel keys, per-token values in 16-channel blocks): head_dim 64 with
     * 2-bit keys and groups of 16, 256 with hidden value groups, 128 with groups of 64 */
    cases[N - 3] = (sweep_case){2, 4, 1, 0, 16, 64, 8, 2, 16};
    cases[N - 2] = (sweep_case){4, 2, 1, 1, 32, 256, 16, 4, 32};
    cases[N - 1] = (sweep_case){2, 2, 1, 0, 64, 128, 32, 8, 64};
    int compiled = 0, refused = 0;
    for (int i = 0; i < N; i++) {
        const sweep_case *c = &cases[i];
        const char *arch = i % 2 ? "sm_90" : "sm_80";
        int sm = i % 2 ? 90 : 80;
        char text[512];
        spec_text(c, text, sizeof text);
        th_begin("sweep %d (%s): K %d-bit %s, V %d-bit %s, group %d, head_dim %d, %d/%d heads", i, arch, c->kbits,
                 c->kchan ? "per channel" : "per token", c->vbits, c->vhidden ? "hidden" : "per token", c->group, c->D,
                 c->heads, c->kv_heads);
        kvq_spec *spec = NULL;
        kvq_status st = kvq_spec_parse_string("sweep", text, strlen(text), &spec);
        if (st != KVQ_OK) {
            /* the language refuses it: nothing for the target to do */
            printf("  (not a valid spec: %s)", text);
            kvq_spec_free(spec);
            th_end();
            continue;
        }
        kvq_dims dims = {2, c->heads, c->kv_heads, c->D};
        kvq_plan *p = kvq_malloc(sizeof *p);
        char msg[512] = "";
        TH_CHECK(p != NULL, "no memory");
        st = p ? plan_build(kvq_spec_scheme_at(spec, 0), &dims, KVQ_F32, p, msg, sizeof msg) : KVQ_ERR_NOMEM;
        if (st == KVQ_OK) st = plan_check_target(p, sm, msg, sizeof msg);
        if (st != KVQ_OK) {
            TH_CHECK(msg[0] != '\0', "refused without a reason");
            printf("  refused: %s\n", msg);
            refused++;
        } else {
            char *src = NULL;
            TH_CHECK(emit_cuda_source(p, &src, NULL) == KVQ_OK, "emit");
            cu_compiled out;
            char *diag = NULL;
            kvq_status cs = src ? cu_nvrtc_compile(src, arch, 1, &out, &diag, msg, sizeof msg) : KVQ_ERR_NOMEM;
            TH_CHECK(cs == KVQ_OK, "NVRTC: %s", msg);
            if (cs == KVQ_OK) {
                compiled++;
                int seen = 0;
                for (int k = 0; k < out.n_res; k++) {
                    const cu_kernel_res *r = &out.res[k];
                    if (strncmp(r->name, "kvq_decode_c", 12) != 0) continue;
                    seen++;
                    TH_CHECK(r->smem == 0, "%s: %d bytes of static shared memory", r->name, r->smem);
                    /* at most a value or two outside the loops at 128 registers (test_cuda_nvrtc, docs/cuda.md) */
                    TH_CHECK(r->spill_stores <= 16 && r->lmem <= 16, "%s spills (%d stores, %d lmem)", r->name,
                             r->spill_stores, r->lmem);
                }
                TH_CHECK(seen == p->n_classes, "%d decode kernels for %d classes", seen, p->n_classes);
                for (int k = 0; k < p->n_classes; k++)
                    TH_CHECK(p->cls[k].smem <= plan_smem_optin(sm), "class %d: %d bytes", k, p->cls[k].smem);
                cu_compiled_free(&out);
            }
            kvq_free(diag);
            kvq_free(src);
        }
        kvq_free(p);
        kvq_spec_free(spec);
        th_end();
    }
    printf("sweep: %d compiled, %d refused with a reason\n", compiled, refused);
    return th_summary();
}
