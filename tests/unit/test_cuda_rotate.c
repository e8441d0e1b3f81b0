/* Rotations on the emu backend (the cuda backend's code on the emulator device) against the reference: the engine
 * rotates rows, queries and outputs on the host (docs/runtime.md, "Rotations"), so the device kernels are the
 * unrotated schemes' and must agree within 1e-3, read_cache identical. The device-tensor path refuses a rotating
 * layer clearly. Without the emulator: "skipped: <reason>", exit 0. */
#include "test_rotate_util.h"

static void test_device_refusal(void)
{
    th_begin("emu backend: kvq_decode_device on a rotated layer is KVQ_ERR_UNSUPPORTED, naming the rotation");
    kvq_spec *sp = tu_spec_text("scheme r { bits 4; residual 32; rotate hadamard; }\n");
    char err[512] = "";
    kvq_engine *e = sp ? tr_engine(kvq_spec_scheme(sp, "r"), KVQ_BACKEND_EMU, 1, 2, 1, 64, err, sizeof err) : NULL;
    kvq_seq *s = NULL;
    TH_CHECK(e && kvq_seq_create(e, &s) == KVQ_OK, "engine: %s", err);
    float k[64 * 4], v[64 * 4];
    tu_fill(k, 64 * 4, 1);
    tu_fill(v, 64 * 4, 1);
    kvq_prefill_item it = {s, 4, k, v, NULL};
    TH_CHECK(e && kvq_prefill(e, 0, &it, 1) == KVQ_OK, "prefill: %s", e ? kvq_engine_errmsg(e) : "");
    uint16_t dummy[256];
    kvq_dev_tensor t = {dummy, KVQ_F16, 0, 64};
    kvq_dev_decode b;
    memset(&b, 0, sizeof b);
    b.seqs = &s;
    b.n_seqs = 1;
    b.q = b.k = b.v = b.out = t;
    kvq_status st = e ? kvq_decode_device(e, 0, &b) : KVQ_ERR_INVALID;
    TH_CHECK(st == KVQ_ERR_UNSUPPORTED && strstr(kvq_engine_errmsg(e), "rotat"), "status %s: %s", kvq_status_str(st),
             e ? kvq_engine_errmsg(e) : "");
    kvq_engine_free(e);
    kvq_spec_free(sp);
    th_end();
}

int main(void)
{
    kvq_spec *fp = tu_spec_text("scheme f { }");
    char err[512] = "";
    kvq_engine *probe = fp ? tr_engine(kvq_spec_scheme(fp, NULL), KVQ_BACKEND_EMU, 1, 1, 1, 64, err, sizeof err) : NULL;
    kvq_engine_free(probe);
    kvq_spec_free(fp);
    if (!probe) {
        printf("skipped: %s\n", err);
        return 0;
    }
    static const char *names[] = {"kivi2_had", "kivi4_rand", "ott_had", "zip_rand"};
    for (int i = 0; i < 4; i++) {
        int D = i % 2 ? 96 : 128;
        th_begin("emu backend against the reference: %s, D %d, 8 heads / 2 kv heads: decode within 1e-3, read_cache "
                 "identical",
                 names[i], D);
        tr_compare(tr_specs, names[i], KVQ_BACKEND_EMU, 8, 2, D);
        th_end();
    }
    test_device_refusal();
    return th_summary();
}
