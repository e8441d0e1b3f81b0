/* A host program as a user writes it against an installed kvq: built with `pkg-config --cflags --libs kvq` by
 * tests/sh/test_install.sh. Parses a spec, prefills and decodes a few tokens of a 2-layer GQA model on the
 * given backend, and checks the outputs against exact attention over the same fp32 K/V (within the scheme's
 * loss). Prints what the shell test checks: the version, the data directory and the error. */
#include <kvq.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { L = 2, H = 4, HKV = 2, D = 64, N = 48, STEPS = 4, T = N + STEPS };

static float frand(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return ((float)((*s >> 8) & 0xffff) / 65536.0f - 0.5f) * 2.0f;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: host SPEC BACKEND(reference|emu|cpu)\n");
        return 2;
    }
    printf("version %s %s\n", kvq_version(), KVQ_VERSION);
    printf("data_dir %s\n", kvq_data_dir());
    kvq_spec *spec = NULL;
    if (kvq_spec_parse_file(argv[1], &spec) != KVQ_OK) {
        for (int i = 0; spec && i < kvq_spec_diag_count(spec); i++) {
            char buf[512];
            kvq_diag_format(kvq_spec_diag(spec, i), buf, sizeof buf);
            fprintf(stderr, "%s\n", buf);
        }
        kvq_spec_free(spec);
        return 1;
    }
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){L, H, HKV, D};
    cfg.dtype = KVQ_F32;
    cfg.backend = !strcmp(argv[2], "emu") ? KVQ_BACKEND_EMU : !strcmp(argv[2], "cpu") ? KVQ_BACKEND_CPU
                                                                                          : KVQ_BACKEND_REFERENCE;
    kvq_engine *eng = NULL;
    char err[512];
    if (kvq_engine_create(kvq_spec_scheme(spec, NULL), &cfg, &eng, err, sizeof err) != KVQ_OK) {
        fprintf(stderr, "engine: %s\n", err);
        kvq_spec_free(spec);
        return 1;
    }
    static float k[L][HKV][T][D], v[L][HKV][T][D], q[L][H][T][D], pk[HKV][N][D], pv[HKV][N][D], pq[H][N][D];
    static float sk[HKV][D], sv[HKV][D], sq[H][D], out[H][D];
    unsigned s = 7;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < HKV; h++)
                for (int d = 0; d < D; d++) k[l][h][t][d] = frand(&s), v[l][h][t][d] = frand(&s);
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) q[l][h][t][d] = frand(&s);
        }
    kvq_seq *seq = NULL;
    int rc = 1;
    if (kvq_seq_create(eng, &seq) != KVQ_OK) goto fail;
    for (int l = 0; l < L; l++) {
        for (int h = 0; h < HKV; h++) memcpy(pk[h], k[l][h], sizeof pk[h]), memcpy(pv[h], v[l][h], sizeof pv[h]);
        for (int h = 0; h < H; h++) memcpy(pq[h], q[l][h], sizeof pq[h]);
        kvq_prefill_item it = {seq, N, pk, pv, pq};
        if (kvq_prefill(eng, l, &it, 1) != KVQ_OK) goto fail;
    }
    double num = 0, den = 0;
    for (int t = N; t < T; t++)
        for (int l = 0; l < L; l++) {
            for (int h = 0; h < HKV; h++) memcpy(sk[h], k[l][h][t], sizeof sk[h]), memcpy(sv[h], v[l][h][t], sizeof sv[h]);
            for (int h = 0; h < H; h++) memcpy(sq[h], q[l][h][t], sizeof sq[h]);
            kvq_decode_item it = {seq, sk, sv, sq, &out[0][0]};
            if (kvq_decode(eng, l, &it, 1) != KVQ_OK) goto fail;
            for (int h = 0; h < H; h++) { /* exact attention of query head h over kv head h / (H / HKV) */
                const int g = h / (H / HKV);
                double w[T], m = -1e300, z = 0;
                for (int j = 0; j <= t; j++) {
                    double dot = 0;
                    for (int d = 0; d < D; d++) dot += (double)q[l][h][t][d] * k[l][g][j][d];
                    w[j] = dot / sqrt((double)D);
                    if (w[j] > m) m = w[j];
                }
                for (int j = 0; j <= t; j++) z += w[j] = exp(w[j] - m);
                for (int d = 0; d < D; d++) {
                    double ref = 0;
                    for (int j = 0; j <= t; j++) ref += w[j] / z * v[l][g][j][d];
                    num += (out[h][d] - ref) * (out[h][d] - ref);
                    den += ref * ref;
                }
            }
        }
    kvq_mem_stats m;
    if (kvq_engine_stats(eng, &m) != KVQ_OK) goto fail;
    printf("attn_rel_err %.6f\neffective_bits %.3f\n", sqrt(num / den), m.effective_bits);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "kvq: %s\n", kvq_engine_errmsg(eng));
done:
    kvq_engine_free(eng);
    kvq_spec_free(spec);
    return rc;
}
