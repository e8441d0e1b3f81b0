/* docs/layout.md's byte counts, checked: the rows of its tables marked `E<n>` (one page) and `C<n>` (a whole
 * cache) are parsed from the document and compared with kvq_page_layout_compute, kvq_scheme_account and the
 * reference runtime's kvq_engine_stats. A number changed on one side only fails here. Also the bit order of
 * codes as the document draws it, read back through the runtime. */
#include "layout.h"
#include "quant.h"
#include "scheme.h"
#include "test_engine_util.h"

typedef struct {
    int H, D, bits, gran, group, cs, masked, sdt, zdt, cap;
} page_ex;

/* E1..E6 of docs/layout.md, "Worked pages". */
static const page_ex pages[] = {
    {8, 128, 2, KVQ_GRAN_CHANNEL, 32, 0, 0, KVQ_DT_FP16, KVQ_DT_FP16, 32},               /* E1 KIVI-2 keys */
    {8, 128, 2, KVQ_GRAN_TOKEN, 32, 0, 0, KVQ_DT_FP16, KVQ_DT_FP16, KVQ_APPEND_PAGE_TOKENS}, /* E2 KIVI-2 values */
    {8, 128, 4, KVQ_GRAN_TOKEN, KVQ_GROUP_HIDDEN, 1, 0, KVQ_DT_FP16, KVQ_DT_FP16, 60},  /* E3 ZipCache values */
    {8, 128, 2, KVQ_GRAN_CHANNEL, 128, 0, 1, KVQ_DT_FP16, KVQ_DT_FP16, 128},            /* E4 OTT keys */
    {1, 96, 3, KVQ_GRAN_TOKEN, 32, 0, 0, KVQ_DT_FP32, KVQ_DT_FP16, 5},                  /* E5 3-bit values */
    {2, 64, 1, KVQ_GRAN_CHANNEL, 8, 0, 1, KVQ_DT_FP16, KVQ_DT_FP16, 5},                 /* E6 short 1-bit page */
};

static char *read_doc(void)
{
    FILE *f = fopen(th_path("docs/layout.md"), "rb");
    if (!f) return NULL;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return buf;
}

/* Finds the table row starting with "| <id> " and parses its numbers (after the label cell). */
static int row(const char *doc, const char *id, unsigned long long *v, int max)
{
    char key[16];
    snprintf(key, sizeof key, "\n| %s ", id);
    const char *p = strstr(doc, key);
    if (!p) return -1;
    p = strchr(p + 2, '|'); /* end of the label cell */
    int n = 0;
    while (p && *p == '|' && n < max) {
        p++;
        char *end;
        unsigned long long x = strtoull(p, &end, 10);
        if (end == p) break;
        v[n++] = x;
        p = strchr(end, '|');
        if (p && p[1] == '\n') break;
    }
    return n;
}

static void test_pages(const char *doc)
{
    th_begin("layout.md: worked pages E1..E6 (section sizes and total)");
    for (size_t i = 0; i < sizeof pages / sizeof pages[0]; i++) {
        const page_ex *x = &pages[i];
        kvq_tensor_cfg t = {.bits = x->bits, .gran = (kvq_gran)x->gran, .channel_separable = x->cs, .group = x->group,
                            .scale_dtype = (kvq_param_dtype)x->sdt, .zero_dtype = (kvq_param_dtype)x->zdt};
        kvq_page_format f;
        kvq_page_layout lay;
        kvq_page_format_init(&f, &t, x->bits, x->masked, x->H, x->D, x->cap);
        kvq_page_layout_compute(&f, &lay);
        unsigned long long want[6] = {lay.codes_size, lay.scale_size, lay.zero_size, lay.factor_size, lay.mask_size,
                                      lay.total};
        unsigned long long got[6];
        char id[8];
        snprintf(id, sizeof id, "E%zu", i + 1);
        int n = row(doc, id, got, 6);
        TH_CHECK(n == 6, "row %s not found or malformed (%d numbers)", id, n);
        for (int j = 0; j < 6 && n == 6; j++)
            TH_CHECK(got[j] == want[j], "%s column %d: document %llu, layout %llu", id, j + 1, got[j], want[j]);
        /* Offsets are the running sum of the sections, each 16-byte aligned. */
        TH_CHECK(lay.scale == lay.codes_size && lay.zero == lay.scale + lay.scale_size && lay.total % 16 == 0,
                 "%s: offsets", id);
    }
    th_end();
}

/* C1: kivi2 (specs/kivi2.kvq), 1 layer, 32 heads, 8 kv heads, head_dim 128, batch 1, prefill 1000.
 * C2: ott (specs/ott.kvq) at layer 2 dims (3 layers, so layers 0-1 have no pool), prefill 1000.
 * C3: zipcache (specs/zipcache.kvq), 1 layer, prefill 1000. */
static void test_caches(const char *doc)
{
    static const struct {
        const char *id, *file;
        int layers;
    } cs[] = {{"C1", "specs/kivi2.kvq", 1}, {"C2", "specs/ott.kvq", 3}, {"C3", "specs/zipcache.kvq", 1}};
    enum { T = 1000, H = 8, HQ = 32, D = 128 };
    th_begin("layout.md: whole caches C1..C3 (bytes by segment) == kvq_scheme_account == runtime stats");
    float *k = malloc(sizeof(float) * H * T * D), *v = malloc(sizeof(float) * H * T * D),
          *q = malloc(sizeof(float) * HQ * T * D);
    tu_fill(k, (size_t)H * T * D, 1.0f);
    tu_fill(v, (size_t)H * T * D, 1.0f);
    tu_fill(q, (size_t)HQ * T * D, 0.2f);
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        kvq_spec *spec = tu_spec_file(cs[i].file);
        if (!spec) continue;
        const kvq_scheme *sch = kvq_spec_scheme(spec, NULL);
        kvq_dims d = {cs[i].layers, HQ, H, D};
        kvq_mem_stats acc, run;
        TH_CHECK(kvq_scheme_account(sch, &d, 1, T, NULL, &acc) == KVQ_OK, "account");
        kvq_engine *e = tu_engine(sch, cs[i].layers, HQ, H, D, KVQ_F32);
        kvq_seq *s = NULL;
        if (e && kvq_seq_create(e, &s) == KVQ_OK) {
            for (int l = 0; l < cs[i].layers; l++) {
                kvq_prefill_item it = {s, T, k, v, q};
                TH_CHECK(kvq_prefill(e, l, &it, 1) == KVQ_OK, "prefill: %s", kvq_engine_errmsg(e));
            }
            kvq_engine_stats(e, &run);
            TH_CHECK(memcmp(acc.bytes, run.bytes, sizeof acc.bytes) == 0, "%s: runtime differs from the account",
                     cs[i].id);
        }
        kvq_engine_free(e);
        /* Columns: sinks body_high body_low params outlier spill residual device fp16 */
        static const kvq_segment cols[7] = {KVQ_SEG_SINK,    KVQ_SEG_BODY_HIGH, KVQ_SEG_BODY_LOW, KVQ_SEG_PARAMS,
                                            KVQ_SEG_OUTLIER, KVQ_SEG_SPILL,     KVQ_SEG_RESIDUAL};
        unsigned long long want[9], got[9];
        for (int j = 0; j < 7; j++) want[j] = acc.bytes[cols[j]];
        want[7] = acc.device_bytes;
        want[8] = acc.fp16_bytes;
        int n = row(doc, cs[i].id, got, 9);
        TH_CHECK(n == 9, "row %s not found or malformed (%d numbers)", cs[i].id, n);
        for (int j = 0; j < 9 && n == 9; j++)
            TH_CHECK(got[j] == want[j], "%s column %d: document %llu, accounting %llu", cs[i].id, j + 1, got[j],
                     want[j]);
        kvq_spec_free(spec);
    }
    free(k), free(v), free(q);
    th_end();
}

/* The pictures of the bit order: 2-bit codes c0..c3 of channels 0..3 make byte 0 = c0 | c1<<2 | c2<<4 | c3<<6;
 * 3-bit codes are a 2-bit plane then a 1-bit plane (checked on the packer every page uses). */
static void test_bit_order(void)
{
    th_begin("layout.md: code bit order (2-bit codes 0 1 2 3 pack to byte 0xe4; 3-bit as two planes)");
    uint8_t codes[32], out[32];
    for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(i % 4);
    kvq_pack_codes(codes, 32, 2, out);
    TH_CHECK(out[0] == 0xe4 && out[7] == 0xe4, "2-bit byte 0 = 0x%02x", out[0]);
    for (int i = 0; i < 32; i++) codes[i] = (uint8_t)(i % 8);
    kvq_pack_codes(codes, 32, 3, out);
    /* low plane: 0 1 2 3 0 1 2 3 ... -> 0xe4; high plane: bit 2 of 0..7 -> 0 0 0 0 1 1 1 1 -> 0xf0 */
    TH_CHECK(out[0] == 0xe4 && out[8] == 0xf0, "3-bit planes 0x%02x 0x%02x", out[0], out[8]);
    th_end();
}

/* The page cut of a flush (kvq_flush_page_tokens, layout.md "What a prefill allocates"): per channel the group,
 * per token everything, and bits 16 everything whatever the granularity (fp16 keys default to per channel). */
static void test_page_cut(void)
{
    th_begin("layout.md: a flush's page capacities (per channel: the group; per token and bits 16: all of it)");
    kvq_tensor_cfg ch = {.bits = 2, .gran = KVQ_GRAN_CHANNEL, .channel_separable = 0, .group = 32,
                         .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
    kvq_tensor_cfg tok = {.bits = 2, .gran = KVQ_GRAN_TOKEN, .channel_separable = 0, .group = 32,
                          .scale_dtype = KVQ_DT_FP16, .zero_dtype = KVQ_DT_FP16};
    kvq_tensor_cfg f16 = {.bits = 16, .gran = KVQ_GRAN_CHANNEL, .group = 32};
    TH_CHECK(kvq_flush_page_tokens(&ch, 1000) == 32 && kvq_flush_page_tokens(&ch, 5) == 5, "per channel: %d %d",
             kvq_flush_page_tokens(&ch, 1000), kvq_flush_page_tokens(&ch, 5));
    TH_CHECK(kvq_flush_page_tokens(&tok, 1000) == 1000, "per token: %d", kvq_flush_page_tokens(&tok, 1000));
    TH_CHECK(kvq_flush_page_tokens(&f16, 65536) == 65536, "bits 16 per channel: %d",
             kvq_flush_page_tokens(&f16, 65536));
    th_end();
}

int main(void)
{
    const char *doc = read_doc();
    th_begin("layout.md: present");
    TH_CHECK(doc != NULL, "docs/layout.md not found");
    th_end();
    if (doc) {
        test_pages(doc);
        test_caches(doc);
    }
    test_bit_order();
    test_page_cut();
    return th_summary();
}
