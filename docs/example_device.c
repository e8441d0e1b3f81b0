/* A small model's attention, layer by layer, with kvq's device tensors on a stream (docs/cuda.md, "Device
 * tensors"). What an inference engine does each step: its own kernels produce q, k and v of every layer in
 * device memory (here: one fused [tokens][heads + 2 kv_heads][head_dim] fp16 buffer a layer, as a QKV projection
 * writes them), kvq appends k and v to the quantized cache and attends, and the output goes on into the next
 * layer. Nothing is synchronised inside a step; the program waits for the stream only to print.
 *
 * The "model" is a toy (each layer's q, k, v are a fixed mix of the previous layer's output and a per-layer
 * pattern) so that the example is self-contained; it checks itself against the host-pointer API on a second
 * engine, which must give the same outputs bit for bit.
 *
 * Device memory: with the cuda backend it is cuMemAlloc'd (libcuda through dlopen, no toolkit needed); with the
 * emu backend (the SIMT emulator kvq's tests run on) kvq's "device" memory is host memory, so plain malloc.
 *
 *   cc -Iruntime/include docs/example_device.c build/libkvq.a -lm -ldl -lpthread $(llvm-config-19 --ldflags
 *      --libs) -o example_device && ./example_device specs/kivi2.kvq emu
 * (tests/unit/test_cuda_example.c compiles and runs it under the emulator.) */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq.h"

enum { LAYERS = 4, HEADS = 8, KV_HEADS = 2, HEAD_DIM = 128, BATCH = 3, PROMPT = 40, STEPS = 6 };
#define ROW (HEADS + 2 * KV_HEADS) /* heads of a fused qkv row */

/* ---- a minimal device layer: libcuda's driver API, or host memory for the emulator ---- */
static struct {
    int gpu;
    int (*alloc)(unsigned long long *, size_t);
    int (*free_)(unsigned long long);
    int (*htod)(unsigned long long, const void *, size_t, void *);
    int (*dtoh)(void *, unsigned long long, size_t, void *);
    int (*sync)(void *);
    int (*stream_create)(void **, unsigned);
    int (*stream_destroy)(void *);
    void *stream;
} dev;

static int dev_init(int gpu)
{
    dev.gpu = gpu;
    if (!gpu) return 0;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (!h) return -1;
    /* the engine (created after this) binds to the context current here: the primary one kvq also uses */
    *(void **)&dev.alloc = dlsym(h, "cuMemAlloc_v2");
    *(void **)&dev.free_ = dlsym(h, "cuMemFree_v2");
    *(void **)&dev.htod = dlsym(h, "cuMemcpyHtoDAsync_v2");
    *(void **)&dev.dtoh = dlsym(h, "cuMemcpyDtoHAsync_v2");
    *(void **)&dev.sync = dlsym(h, "cuStreamSynchronize");
    *(void **)&dev.stream_create = dlsym(h, "cuStreamCreate");
    *(void **)&dev.stream_destroy = dlsym(h, "cuStreamDestroy_v2");
    return dev.alloc && dev.free_ && dev.htod && dev.dtoh && dev.sync && dev.stream_create ? 0 : -1;
}

static void *dev_malloc(size_t n)
{
    if (!dev.gpu) return calloc(1, n);
    unsigned long long p = 0;
    return dev.alloc(&p, n) ? NULL : (void *)(uintptr_t)p;
}
static void dev_free(void *p)
{
    if (!dev.gpu)
        free(p);
    else if (p)
        dev.free_((unsigned long long)(uintptr_t)p);
}
static void upload(void *dst, const void *src, size_t n)
{
    if (!dev.gpu)
        memcpy(dst, src, n);
    else
        dev.htod((unsigned long long)(uintptr_t)dst, src, n, dev.stream);
}
static void download(void *dst, const void *src, size_t n)
{
    if (!dev.gpu) {
        memcpy(dst, src, n);
        return;
    }
    dev.dtoh(dst, (unsigned long long)(uintptr_t)src, n, dev.stream);
    dev.sync(dev.stream);
}

/* ---- the toy model ---- */
static uint16_t f16(float f) /* round to nearest even, finite inputs of moderate size */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    uint32_t m = u & 0x7fffffu;
    if (e <= 0) { /* subnormal */
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000u;
        int shift = 14 - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = (uint32_t)e << 10 | m >> 13, rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

/* Row (token t of sequence b, layer l) of the fused qkv: a pattern plus a little of the previous layer's output
 * (prev: [HEADS][HEAD_DIM] fp32, or NULL). */
static void qkv_row(uint16_t *row, int l, int b, int t, const float *prev)
{
    for (int h = 0; h < ROW; h++)
        for (int d = 0; d < HEAD_DIM; d++) {
            float x = sinf(0.37f * (float)(d + 1) * (float)(h + 1) + 0.11f * (float)t + 0.7f * (float)(l + b));
            if (prev) x += 0.25f * prev[(h % HEADS) * HEAD_DIM + d];
            row[h * HEAD_DIM + d] = f16(x);
        }
}

int main(int argc, char **argv)
{
    const char *spec_path = argc > 1 ? argv[1] : "specs/kivi2.kvq";
    int gpu = argc > 2 && !strcmp(argv[2], "cuda");
    if (dev_init(gpu)) {
        printf("example: no CUDA driver\n");
        return 0;
    }
    kvq_spec *spec = NULL;
    if (kvq_spec_parse_file(spec_path, &spec) != KVQ_OK) {
        fprintf(stderr, "example: %s does not parse\n", spec_path);
        kvq_spec_free(spec);
        return 1;
    }
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.dims = (kvq_dims){LAYERS, HEADS, KV_HEADS, HEAD_DIM};
    cfg.dtype = KVQ_F16;
    cfg.backend = gpu ? KVQ_BACKEND_CUDA : KVQ_BACKEND_EMU;
    kvq_engine *e = NULL, *host = NULL; /* host: the same model through the host-pointer API, to compare */
    char err[512];
    if (kvq_engine_create(kvq_spec_scheme_at(spec, 0), &cfg, &e, err, sizeof err) != KVQ_OK ||
        kvq_engine_create(kvq_spec_scheme_at(spec, 0), &cfg, &host, err, sizeof err) != KVQ_OK) {
        printf("example: %s\n", err); /* e.g. the backend is unavailable here */
        kvq_engine_free(e);
        kvq_spec_free(spec);
        return 0;
    }
    if (gpu) dev.stream_create(&dev.stream, 1 /* non-blocking */);
    /* a serving engine reserves its cache memory once: then no step allocates */
    kvq_engine_reserve_device(e, (size_t)64 << 20);

    kvq_seq *seq[BATCH], *hseq[BATCH];
    for (int b = 0; b < BATCH; b++) kvq_seq_create(e, &seq[b]), kvq_seq_create(host, &hseq[b]);
    int cu_seqlens[BATCH + 1] = {0};
    for (int b = 0; b < BATCH; b++) cu_seqlens[b + 1] = cu_seqlens[b] + PROMPT + 7 * b; /* varlen prompts */
    int total = cu_seqlens[BATCH], rc = 0;
    size_t row_bytes = (size_t)ROW * HEAD_DIM * 2;
    uint16_t *h_rows = malloc((size_t)total * row_bytes);
    uint16_t *d_rows = dev_malloc((size_t)total * row_bytes); /* device: the fused q|k|v of a prefill or step */
    float *d_out = dev_malloc((size_t)BATCH * HEADS * HEAD_DIM * 4), *d_lse = dev_malloc((size_t)BATCH * HEADS * 4);
    float *out = malloc((size_t)BATCH * HEADS * HEAD_DIM * 4), *hout = malloc((size_t)BATCH * HEADS * HEAD_DIM * 4);
    float *prev = calloc((size_t)BATCH * HEADS * HEAD_DIM, 4);
    uint16_t *hk = malloc((size_t)KV_HEADS * (PROMPT + 7 * BATCH) * HEAD_DIM * 2),
             *hv = malloc((size_t)KV_HEADS * (PROMPT + 7 * BATCH) * HEAD_DIM * 2),
             *hq = malloc((size_t)HEADS * (PROMPT + 7 * BATCH) * HEAD_DIM * 2);
    /* views of the fused rows: token stride ROW * HEAD_DIM, head stride HEAD_DIM */
    kvq_dev_tensor q = {d_rows, KVQ_F16, ROW * HEAD_DIM, HEAD_DIM};
    kvq_dev_tensor k = {d_rows + HEADS * HEAD_DIM, KVQ_F16, ROW * HEAD_DIM, HEAD_DIM};
    kvq_dev_tensor v = {d_rows + (HEADS + KV_HEADS) * HEAD_DIM, KVQ_F16, ROW * HEAD_DIM, HEAD_DIM};

    /* prefill, layer by layer: the batch's prompts packed varlen */
    for (int l = 0; l < LAYERS && rc == 0; l++) {
        for (int b = 0; b < BATCH; b++)
            for (int t = 0; t < cu_seqlens[b + 1] - cu_seqlens[b]; t++)
                qkv_row(h_rows + (size_t)(cu_seqlens[b] + t) * ROW * HEAD_DIM, l, b, t, NULL);
        upload(d_rows, h_rows, (size_t)total * row_bytes);
        kvq_dev_prefill p = {seq, BATCH, cu_seqlens, q, k, v, dev.stream};
        if (kvq_prefill_device(e, l, &p) != KVQ_OK) {
            fprintf(stderr, "example: prefill: %s\n", kvq_engine_errmsg(e));
            rc = 1;
        }
        for (int b = 0; b < BATCH && rc == 0; b++) { /* the host engine: [heads][T][D] per sequence */
            int T = cu_seqlens[b + 1] - cu_seqlens[b];
            for (int t = 0; t < T; t++) {
                const uint16_t *r = h_rows + (size_t)(cu_seqlens[b] + t) * ROW * HEAD_DIM;
                for (int h = 0; h < HEADS; h++) memcpy(hq + ((size_t)h * T + t) * HEAD_DIM, r + h * HEAD_DIM, HEAD_DIM * 2);
                for (int h = 0; h < KV_HEADS; h++) {
                    memcpy(hk + ((size_t)h * T + t) * HEAD_DIM, r + (HEADS + h) * HEAD_DIM, HEAD_DIM * 2);
                    memcpy(hv + ((size_t)h * T + t) * HEAD_DIM, r + (HEADS + KV_HEADS + h) * HEAD_DIM, HEAD_DIM * 2);
                }
            }
            kvq_prefill_item it = {hseq[b], T, hk, hv, hq};
            if (kvq_prefill(host, l, &it, 1) != KVQ_OK) rc = 1;
        }
    }
    /* decode: each step runs the layers in order, each layer's input mixing in the previous layer's output */
    double worst = 0;
    for (int s = 0; s < STEPS && rc == 0; s++) {
        memset(prev, 0, (size_t)BATCH * HEADS * HEAD_DIM * 4);
        for (int l = 0; l < LAYERS && rc == 0; l++) {
            for (int b = 0; b < BATCH; b++)
                qkv_row(h_rows + (size_t)b * ROW * HEAD_DIM, l, b, 1000 + s, l ? prev + (size_t)b * HEADS * HEAD_DIM : NULL);
            upload(d_rows, h_rows, (size_t)BATCH * row_bytes);
            kvq_dev_decode d = {seq, BATCH, q, k, v, {d_out, KVQ_F32, HEADS * HEAD_DIM, HEAD_DIM}, d_lse, dev.stream};
            if (kvq_decode_device(e, l, &d) != KVQ_OK) {
                fprintf(stderr, "example: decode: %s\n", kvq_engine_errmsg(e));
                rc = 1;
                break;
            }
            /* a real engine's next kernel would read d_out on the stream; the toy reads it on the host */
            download(out, d_out, (size_t)BATCH * HEADS * HEAD_DIM * 4);
            kvq_decode_item it[BATCH];
            for (int b = 0; b < BATCH; b++) {
                const uint16_t *r = h_rows + (size_t)b * ROW * HEAD_DIM;
                it[b] = (kvq_decode_item){hseq[b], r + HEADS * HEAD_DIM, r + (HEADS + KV_HEADS) * HEAD_DIM, r,
                                          hout + (size_t)b * HEADS * HEAD_DIM};
            }
            if (kvq_decode(host, l, it, BATCH) != KVQ_OK) rc = 1;
            for (size_t i = 0; i < (size_t)BATCH * HEADS * HEAD_DIM; i++) {
                double dlt = fabs((double)out[i] - hout[i]);
                if (dlt > worst) worst = dlt;
            }
            memcpy(prev, out, (size_t)BATCH * HEADS * HEAD_DIM * 4);
        }
    }
    printf("example: %s, %d layers, batch %d, %d steps on the %s backend: device and host paths differ by %g\n",
           kvq_scheme_name(kvq_spec_scheme_at(spec, 0)), LAYERS, BATCH, STEPS, gpu ? "cuda" : "emu", worst);
    if (worst != 0) rc = 1;
    free(h_rows), free(out), free(hout), free(prev), free(hk), free(hv), free(hq);
    dev_free(d_rows), dev_free(d_out), dev_free(d_lse);
    kvq_engine_free(e);
    kvq_engine_free(host);
    if (gpu && dev.stream) dev.stream_destroy(dev.stream);
    kvq_spec_free(spec);
    return rc;
}
