/* Issue 12 through the C API: bounds and the calls that used to fail silently.
 *   - case 8: kvq_engine_create caps layers, heads and kv_heads at the language's 4096 (layers = INT_MAX used to
 *     return KVQ_OK after 52 s with 23 GB resident): refused at once;
 *   - case 7: one validation (kvq_scheme_check_dims) behind the engine and the accounting: OTT's value group 128
 *     at head_dim 64 is refused by both with the same message;
 *   - case 6: kvq_scheme_account refuses a size beyond 2^63 - 1 (KVQ_ERR_INVALID, *out zeroed) and is exact just
 *     below it;
 *   - case 5: kvq_scheme_account at group 1, 4096 layers, a million tokens: well under a second;
 *   - case 9: kvq_engine_stats / kvq_seq_stats keep their failure's message on the engine;
 *     kvq_engine_write_layer_map on a scheme without classify is KVQ_ERR_STATE with a message, and writes nothing. */
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <sys/stat.h>
#include <sys/wait.h>

#include "harness.h"
#include "npy.h"
#include "kvq.h"
#include "test_engine_util.h"

static double seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static const char kivi[] = "scheme k { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } "
                           "residual 32; }\n";

static void test_engine_caps(void)
{
    th_begin("bounds: kvq_engine_create refuses layers, heads, kv_heads beyond 4096 at once (issue 12 case 8)");
    kvq_spec *sp = tu_spec_text(kivi);
    if (sp) {
        const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
        struct {
            kvq_dims d;
            const char *msg;
        } bad[] = {
            {{INT_MAX, 8, 8, 128}, "layers 2147483647"},
            {{4097, 8, 8, 128}, "at most 4096"},
            {{32, 8192, 8, 128}, "heads 8192"},
            {{32, 8192, 8192, 128}, "kv_heads 8192"},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            kvq_engine_config cfg;
            kvq_engine_config_init(&cfg);
            cfg.dims = bad[i].d;
            kvq_engine *e = NULL;
            char err[512] = "";
            double t0 = seconds();
            kvq_status st = kvq_engine_create(sch, &cfg, &e, err, sizeof err);
            double dt = seconds() - t0;
            TH_CHECK(st == KVQ_ERR_SHAPE && !e, "dims %d %d %d: %s", bad[i].d.layers, bad[i].d.heads,
                     bad[i].d.kv_heads, kvq_status_str(st));
            TH_CHECK(strstr(err, bad[i].msg) != NULL, "message '%s' lacks '%s'", err, bad[i].msg);
            TH_CHECK(dt < 0.5, "refusing took %.2f s", dt);
            kvq_engine_free(e);
        }
        /* the cap itself is fine */
        kvq_engine_config cfg;
        kvq_engine_config_init(&cfg);
        cfg.dims = (kvq_dims){4096, 8, 8, 128};
        kvq_engine *e = NULL;
        char err[512] = "";
        TH_CHECK(kvq_engine_create(sch, &cfg, &e, err, sizeof err) == KVQ_OK, "4096 layers refused: %s", err);
        kvq_engine_free(e);
    }
    kvq_spec_free(sp);
    th_end();
}

static void test_one_validation(void)
{
    th_begin("bounds: engine and accounting refuse OTT's value group 128 at head_dim 64 with one message (case 7)");
    kvq_spec *sp = NULL;
    kvq_status st = kvq_spec_parse_file(th_path("specs/ott.kvq"), &sp);
    TH_CHECK(st == KVQ_OK, "specs/ott.kvq: %s", kvq_status_str(st));
    if (st == KVQ_OK) {
        const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
        kvq_dims d = {32, 32, 8, 64};
        char m1[512] = "", m2[512] = "";
        kvq_status s1 = kvq_scheme_check_dims(sch, &d, m1, sizeof m1);
        kvq_engine_config cfg;
        kvq_engine_config_init(&cfg);
        cfg.dims = d;
        kvq_engine *e = NULL;
        kvq_status s2 = kvq_engine_create(sch, &cfg, &e, m2, sizeof m2);
        kvq_mem_stats m;
        kvq_status s3 = kvq_scheme_account(sch, &d, 1, 4096, NULL, &m);
        TH_CHECK(s1 == KVQ_ERR_SHAPE && s2 == s1 && s3 == s1, "statuses %s %s %s", kvq_status_str(s1),
                 kvq_status_str(s2), kvq_status_str(s3));
        TH_CHECK(!strcmp(m1, m2) && strstr(m1, "value group 128 does not divide head_dim 64"), "messages '%s' / '%s'",
                 m1, m2);
        d.head_dim = 128;
        TH_CHECK(kvq_scheme_check_dims(sch, &d, m1, sizeof m1) == KVQ_OK, "head_dim 128 refused: %s", m1);
        kvq_engine_free(e);
    }
    kvq_spec_free(sp);
    th_end();
}

static void test_account_bounds(void)
{
    th_begin("bounds: kvq_scheme_account refuses sizes beyond 2^63 - 1 and zeroes *out (case 6)");
    kvq_spec *sp = tu_spec_text("scheme pt { key { bits 2; per token; group 32; } value { bits 2; per token; group 32; } "
                           "residual 0; }\n");
    if (sp) {
        const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
        kvq_dims d = {4096, 4096, 4096, 256};
        kvq_mem_stats m;
        memset(&m, 0xab, sizeof m);
        kvq_status st = kvq_scheme_account(sch, &d, 1 << 20, INT_MAX / 2, NULL, &m);
        TH_CHECK(st == KVQ_ERR_INVALID, "largest dims: %s", kvq_status_str(st));
        TH_CHECK(m.device_bytes == 0 && m.fp16_bytes == 0 && m.bytes[KVQ_SEG_BODY_HIGH] == 0, "*out not zeroed");
        /* 1 layer, 1 kv head, head_dim 64, batch 1: fp16 bytes = seq * 64 * 2 * 2, exact and far from the limit */
        d = (kvq_dims){1, 1, 1, 64};
        st = kvq_scheme_account(sch, &d, 1, INT_MAX, NULL, &m);
        TH_CHECK(st == KVQ_OK && m.fp16_bytes == (uint64_t)INT_MAX * 256, "seq INT_MAX: %s, fp16 %llu",
                 kvq_status_str(st), (unsigned long long)m.fp16_bytes);
        /* a product that passes 2^63 only through the batch: 4096 layers * 4096 heads * 256 * 2 * 2 * seq * batch */
        d = (kvq_dims){4096, 4096, 4096, 256};
        st = kvq_scheme_account(sch, &d, 1 << 20, 1 << 20, NULL, &m);
        TH_CHECK(st == KVQ_ERR_INVALID, "2^24 * 2^12 * 2^20 * 2^20 bytes accepted: %s", kvq_status_str(st));
    }
    kvq_spec_free(sp);
    th_end();

    th_begin("bounds: kvq_scheme_account at group 1, 4096 layers, a million tokens in closed form (case 5)");
    sp = tu_spec_text("scheme g1 { key { bits 2; per channel; group 1; } value { bits 2; per token; group 32; } "
                 "residual 0; }\n");
    if (sp) {
        const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
        kvq_dims d = {4096, 32, 8, 128};
        kvq_mem_stats m;
        double t0 = seconds();
        kvq_status st = kvq_scheme_account(sch, &d, 1, 1000000, NULL, &m);
        double dt = seconds() - t0;
        TH_CHECK(st == KVQ_OK, "%s", kvq_status_str(st));
        TH_CHECK(dt < 0.5, "took %.2f s (a loop over pages took 41 s)", dt);
        /* what the page-by-page count gave */
        TH_CHECK(m.bytes[KVQ_SEG_BODY_HIGH] == 2097152000000ull && m.bytes[KVQ_SEG_PARAMS] == 17301504000000ull,
                 "codes %llu, params %llu", (unsigned long long)m.bytes[KVQ_SEG_BODY_HIGH],
                 (unsigned long long)m.bytes[KVQ_SEG_PARAMS]);
    }
    kvq_spec_free(sp);
    th_end();
}

static void test_handle_messages(void)
{
    th_begin("bounds: stats failures keep a message; write_layer_map without classify is KVQ_ERR_STATE (case 9)");
    kvq_spec *sp = tu_spec_text(kivi);
    if (sp) {
        const kvq_scheme *sch = kvq_spec_scheme(sp, NULL);
        kvq_engine_config cfg;
        kvq_engine_config_init(&cfg);
        cfg.dims = (kvq_dims){2, 4, 2, 64};
        kvq_engine *e = NULL, *e2 = NULL;
        char err[512];
        kvq_engine_create(sch, &cfg, &e, err, sizeof err);
        kvq_engine_create(sch, &cfg, &e2, err, sizeof err);
        if (e && e2) {
            kvq_seq *s = NULL, *s2 = NULL;
            kvq_seq_create(e, &s);
            kvq_seq_create(e2, &s2);
            kvq_mem_stats m;
            TH_CHECK(kvq_engine_stats(e, NULL) == KVQ_ERR_INVALID &&
                         strstr(kvq_engine_errmsg(e), "kvq_engine_stats: out is NULL"),
                     "engine stats: '%s'", kvq_engine_errmsg(e));
            TH_CHECK(kvq_seq_stats(e, s2, &m) == KVQ_ERR_INVALID &&
                         strstr(kvq_engine_errmsg(e), "kvq_seq_stats: the sequence belongs to another engine"),
                     "seq stats: '%s'", kvq_engine_errmsg(e));
            TH_CHECK(kvq_seq_stats(e, NULL, &m) == KVQ_ERR_INVALID && strstr(kvq_engine_errmsg(e), "seq is NULL"),
                     "seq stats NULL: '%s'", kvq_engine_errmsg(e));
            TH_CHECK(kvq_seq_stats(e, s, &m) == KVQ_OK, "good stats");
            char path[64];
            snprintf(path, sizeof path, "/tmp/kvq_test_bounds_%d.kvq", (int)getpid());
            unlink(path);
            kvq_status st = kvq_engine_write_layer_map(e, path, "map");
            TH_CHECK(st == KVQ_ERR_STATE && strstr(kvq_engine_errmsg(e), "no classify block"),
                     "write_layer_map without classify: %s '%s'", kvq_status_str(st), kvq_engine_errmsg(e));
            TH_CHECK(access(path, F_OK) != 0, "a map file was written");
            unlink(path);
        }
        kvq_engine_free(e);
        kvq_engine_free(e2);
    }
    kvq_spec_free(sp);
    th_end();
}

/* A .npy header on a pipe claiming 2 TiB of float32, followed by 64 bytes of data: the reader's memory follows
 * what arrives (a buffer that grows with the data), so it reports the truncation instead of allocating what the
 * header claims first (KVQ_ERR_NOMEM, or a sanitizer's allocation-size-too-big abort). */
static void test_npy_pipe_claim(void)
{
    th_begin("bounds: a .npy on a pipe whose header claims 2 TiB is read as a stream: truncated, nothing huge (case 9)");
    char fifo[64];
    snprintf(fifo, sizeof fifo, "/tmp/kvq_test_bounds_fifo_%d", (int)getpid());
    unlink(fifo);
    TH_CHECK(mkfifo(fifo, 0600) == 0, "mkfifo");
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        char hdr[128];
        int n = snprintf(hdr, sizeof hdr, "{'descr': '<f4', 'fortran_order': False, 'shape': (549755813888,), }");
        while (n < 117) hdr[n++] = ' ';
        hdr[n++] = '\n';
        FILE *f = fopen(fifo, "wb");
        if (!f) _exit(1);
        unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)n, 0};
        fwrite(pre, 1, 10, f);
        fwrite(hdr, 1, (size_t)n, f);
        float data[16] = {0};
        fwrite(data, sizeof data[0], 16, f);
        fclose(f);
        _exit(0);
    }
    kvq_npy a;
    char err[512] = "";
    kvq_status st = kvq_npy_read(fifo, &a, err, sizeof err);
    int ws = 0;
    if (pid > 0) waitpid(pid, &ws, 0);
    TH_CHECK(st == KVQ_ERR_FORMAT && strstr(err, "truncated data"), "%s: %s", kvq_status_str(st), err);
    kvq_npy_free(&a);
    unlink(fifo);
    th_end();
}

int main(void)
{
    test_engine_caps();
    test_one_validation();
    test_account_bounds();
    test_handle_messages();
    test_npy_pipe_claim();
    return th_summary();
}
