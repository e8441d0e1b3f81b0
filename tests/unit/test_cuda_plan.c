/* The CUDA compiler's host side: the kernels' page offsets (templates/kvq_layout.cuh, compiled here as C)
 * against layout/layout.c for every format and many capacities; the plan's decode mapping and layer classes;
 * its errors; emit_cuda's determinism and kernel list; SHA-256 test vectors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "emit_cuda.h"
#include "harness.h"
#include "kvq.h"
#include "kvq_layout.cuh"
#include "layout.h"
#include "plan.h"
#include "tiles.h"

static void test_layout(void)
{
    th_begin("layout: kvq_page_offsets (kernels) equals kvq_page_layout_compute (runtime) for every format, and the "
             "page runs' stride kvq_page_stride equals kvq_page_run_stride");
    static const int bits[] = {1, 2, 3, 4, 8, 16}, Ds[] = {64, 96, 128, 256}, Hs[] = {1, 3, 8},
                     caps[] = {1, 7, 32, 64, 100};
    int checked = 0;
    for (size_t bi = 0; bi < 6; bi++)
        for (int gran = 0; gran < 2; gran++)
            for (int gk = 0; gk < 3; gk++)
                for (int sep = 0; sep < 2; sep++)
                    for (int sb = 2; sb <= 4; sb += 2)
                        for (int masked = 0; masked < 2; masked++)
                            for (size_t di = 0; di < 4; di++)
                                for (size_t hi = 0; hi < 3; hi++)
                                    for (size_t ci = 0; ci < 5; ci++) {
                                        int D = Ds[di];
                                        kvq_tensor_cfg t;
                                        memset(&t, 0, sizeof t);
                                        t.bits = bits[bi];
                                        t.gran = (kvq_gran)gran;
                                        t.channel_separable = sep && gran == KVQ_GRAN_TOKEN;
                                        t.group = gk == 0   ? 32
                                                  : gk == 1 ? KVQ_GROUP_ALL
                                                            : (gran ? KVQ_GROUP_HIDDEN : 64);
                                        t.scale_dtype = t.zero_dtype = sb == 4 ? KVQ_DT_FP32 : KVQ_DT_FP16;
                                        kvq_page_format f;
                                        kvq_page_layout l;
                                        kvq_page_format_init(&f, &t, t.bits, masked, Hs[hi], D, caps[ci]);
                                        kvq_page_layout_compute(&f, &l);
                                        kvq_fmt k = {f.bits,   f.gran,        f.channel_separable, f.group,
                                                     f.hidden, f.scale_bytes, f.zero_bytes,        f.masked,
                                                     0,        0,             0,                   0.0f,
                                                     0,
                                                     {0},
                                                     0,        0,             0,                   {{0}}};
                                        kvq_page_off o = kvq_page_offsets(k, Hs[hi], D, caps[ci]);
                                        int same = (size_t)o.codes == l.codes && (size_t)o.scale == l.scale &&
                                                   (size_t)o.zero == l.zero && (size_t)o.factor == l.factor &&
                                                   (size_t)o.mask == l.mask && (size_t)o.total == l.total &&
                                                   (size_t)o.cbpt == l.code_bytes_per_token && o.n_groups == l.n_groups &&
                                                   (size_t)kvq_page_stride(o.total) == kvq_page_run_stride(l.total);
                                        TH_CHECK(same,
                                                 "bits %d gran %d group %d sep %d sbytes %d masked %d H %d D %d cap %d",
                                                 t.bits, gran, t.group, t.channel_separable, sb, masked, Hs[hi], D,
                                                 caps[ci]);
                                        checked++;
                                        if (th_failed()) goto done;
                                    }
done:
    TH_CHECK(checked > 1000, "only %d formats", checked);
    /* element formats (templates/kvq_format.cuh): 1-byte and absent scales, absent zeros, 5-bit codes, the
     * tensor scale section (one, or one per kv head) */
    for (int kind = 1; kind < KVQ_FMT_COUNT && !th_failed(); kind++)
        for (int tsh = 0; tsh < 2; tsh++)
            for (int H = 1; H <= 3; H++) {
                kvq_tensor_cfg t;
                memset(&t, 0, sizeof t);
                t.bits = 4;
                t.gran = KVQ_GRAN_TOKEN;
                t.group = kind == KVQ_FMT_NVFP4 ? 16 : 32;
                t.format.kind = (kvq_format_kind)kind;
                t.format.tensor_scale_per_head = tsh;
                t.format.tensor_scale = 1.0f;
                kvq_page_format f;
                kvq_page_layout l;
                kvq_page_format_init(&f, &t, t.bits, 0, H, 128, 77);
                kvq_page_layout_compute(&f, &l);
                kvq_fmt k = {f.bits, 1, 0, f.group, 0, f.scale_bytes, f.zero_bytes, 0, kind, tsh, 0, 1.0f, 0, {0},
                             0,      0, 0, {{0}}};
                kvq_page_off o = kvq_page_offsets(k, H, 128, 77);
                TH_CHECK((size_t)o.codes == l.codes && (size_t)o.scale == l.scale && (size_t)o.zero == l.zero &&
                             (size_t)o.total == l.total && (size_t)o.cbpt == l.code_bytes_per_token &&
                             (!l.tscale_size || (size_t)o.tscale == l.tscale),
                         "format %s, tensor scale per head %d, H %d: kernel offsets differ from layout.c",
                         kvq_format_name((kvq_format_kind)kind), tsh, H);
            }
    /* TurboQuant (templates/kvq_turboquant.cuh): mse and prod, without and with the outlier split, every code width:
     * the parts' codes, fp32 norms, no zero section for mse, prod's QJL sign rows */
    for (int tq = 1; tq <= 2 && !th_failed(); tq++)
        for (int bits = tq; bits <= 4; bits++)
            for (int split = 0; split < 3; split++)
                for (int H = 1; H <= 3; H++) {
                    const int D = 128, nout = split ? 32 * split : 0, ob = bits == 4 ? tq : 4;
                    kvq_tensor_cfg t;
                    memset(&t, 0, sizeof t);
                    t.bits = bits;
                    t.gran = KVQ_GRAN_TOKEN;
                    t.turboquant = (kvq_turboquant)tq;
                    t.tq_outliers = nout;
                    t.tq_outlier_bits = nout ? ob : 0;
                    kvq_page_format f;
                    kvq_page_layout l;
                    kvq_page_format_init(&f, &t, bits, 0, H, D, 77);
                    kvq_page_layout_compute(&f, &l);
                    kvq_fmt k = {f.bits, 1, 0,  f.group, 0, f.scale_bytes, f.zero_bytes, 0, 0, 0, 0, 0.0f, 0, {0},
                                 tq,     nout, t.tq_outlier_bits, {{0}}};
                    kvq_page_off o = kvq_page_offsets(k, H, D, 77);
                    TH_CHECK((size_t)o.codes == l.codes && (size_t)o.scale == l.scale && (size_t)o.zero == l.zero &&
                                 (size_t)o.qjl == l.qjl && (size_t)o.mask == l.mask && (size_t)o.total == l.total &&
                                 (size_t)o.cbpt == l.code_bytes_per_token && o.n_groups == l.n_groups,
                             "turboquant %s %d bits, outliers %d at %d bits, H %d: kernel offsets differ from layout.c",
                             tq == 2 ? "prod" : "mse", bits, nout, t.tq_outlier_bits, H);
                }
    th_end();
}

static kvq_spec *spec_text(const char *text)
{
    kvq_spec *s = NULL;
    kvq_status st = kvq_spec_parse_string("<test>", text, strlen(text), &s);
    TH_CHECK(st == KVQ_OK, "spec does not parse: %s", text);
    return s;
}

static void test_mapping(void)
{
    th_begin("plan: decode mapping covers head_dim and the GQA group for every shape");
    kvq_spec *sp =
        spec_text("scheme m { bits 2; key { per channel; group 32; } value { per token; group 32; } residual 32; }");
    const kvq_scheme *s = sp ? kvq_spec_scheme(sp, NULL) : NULL;
    static const int Ds[] = {64, 96, 128, 256},
                     G[][2] = {{32, 32}, {32, 8}, {32, 4}, {32, 1}, {64, 1}, {12, 4}, {6, 6}};
    kvq_plan *p = kvq_malloc(sizeof *p);
    for (int di = 0; s && p && di < 4; di++)
        for (int gi = 0; gi < 7; gi++) {
            kvq_dims d = {4, G[gi][0], G[gi][1], Ds[di]};
            char msg[256];
            TH_CHECK(plan_build(s, &d, KVQ_F32, p, msg, sizeof msg) == KVQ_OK, "%s", msg);
            int g = d.heads / d.kv_heads;
            TH_CHECK(p->tx * p->vec >= d.head_dim && p->tx <= 32 && (p->tx & (p->tx - 1)) == 0, "D %d: tx %d", Ds[di],
                     p->tx);
            TH_CHECK(p->ty * p->hpt == g && p->hpt <= 4, "gqa %d: ty %d hpt %d", g, p->ty, p->hpt);
            TH_CHECK(p->threads == p->tx * p->ty * p->tz && p->threads <= 512 && p->tz >= 1 && p->threads % 32 == 0,
                     "D %d gqa %d: %d x %d x %d threads", Ds[di], g, p->tx, p->ty, p->tz);
            const plan_class *c = &p->cls[0];
            TH_CHECK(c->tile == 32 || c->tile == 64 || c->tile == 128 || c->tile == 256, "tile %d", c->tile);
            /* a stage's rows: the tile's code rows (at most 32 KiB of keys and values), or its fp16 rows in fewer
             * tokens (plan_tile_tokens) */
            TH_CHECK(c->rows_bytes <= 64 * 1024 && plan_tile_tokens(c, 1, 1) * 2 * d.head_dim <= c->rows_k,
                     "staging too large: rows %d", c->rows_bytes);
            /* phase 1: split lanes of a warp per token, runs of 8 channels each */
            TH_CHECK(c->split >= 1 && c->split <= 32 && (c->split & (c->split - 1)) == 0 &&
                         d.head_dim % (8 * c->split) == 0 && c->p1 * c->split == p->threads,
                     "split %d p1 %d", c->split, c->p1);
            /* dynamic shared memory: 16-aligned parts in order, within sm_80's opt-in */
            int so[] = {c->so_rows, c->so_kpar, c->so_vpar, c->so_kmask, c->so_q, c->so_qk, c->so_qsum, c->so_red,
                        c->smem};
            for (int k = 0; k + 1 < 9; k++) TH_CHECK(so[k] % 16 == 0 && so[k] < so[k + 1], "offset %d", k);
            /* the scores [T][GQA]: their own part before the reductions, or the key parameters' (per-channel keys:
             * read before phase 1 writes the scores) */
            const int pown = c->so_p > c->so_qsum;
            TH_CHECK(c->so_p % 16 == 0 &&
                         (pown ? c->so_red - c->so_p >= c->tile * g * 4
                               : c->so_p == c->so_kpar && c->so_vpar - c->so_kpar >= c->tile * g * 4),
                     "scores at %d (kpar %d, vpar %d, qsum %d, red %d)", c->so_p, c->so_kpar, c->so_vpar, c->so_qsum,
                     c->so_red);
            /* rows sized for the pages (2-bit here), fp16 rows cut to what fits (plan_tile_tokens) */
            TH_CHECK(c->so_kpar - c->so_rows >= c->rows_bytes && c->rows_k >= c->tile * d.head_dim / 4 &&
                         c->rows_bytes - c->rows_k >= c->tile * d.head_dim / 4 &&
                         c->tile_k16 * 2 * d.head_dim <= c->rows_k &&
                         c->tile_v16 * 2 * d.head_dim <= c->rows_bytes - c->rows_k && c->tile_k16 >= 1 &&
                         c->tile_v16 >= 1 && plan_tile_tokens(c, 1, 0) == c->tile_k16 &&
                         plan_tile_tokens(c, 0, 0) == c->tile,
                     "rows region: %d (keys %d), fp16 tiles %d/%d", c->rows_bytes, c->rows_k, c->tile_k16, c->tile_v16);
            /* page runs (layout/tiles.h): a fold, a bias and its partial sums per key page a tile spans */
            int KP = kvq_tile_max_pages(c->tile, 32);
            TH_CHECK(c->kpages == KP && c->kpar >= KP * d.head_dim, "tile %d: kpages %d kpar %d", c->tile, c->kpages,
                     c->kpar);
            TH_CHECK(c->so_qsum - c->so_qk >= d.head_dim * g * 4 * KP &&
                         (pown ? c->so_p : c->so_red) - c->so_qsum >= (d.head_dim / 8 + KP) * g * 4 &&
                         c->smem - c->so_red >= (p->threads / 32 + 8 * KP + 2) * g * 4,
                     "fold regions for %d pages", KP);
            /* up to GQA 16 every shape fits sm_80; larger groups may be refused, with the reason */
            kvq_status ts = plan_check_target(p, 80, msg, sizeof msg);
            TH_CHECK(ts == KVQ_OK || (g > 16 && strstr(msg, "GQA") != NULL), "gqa %d sm_80: %s", g, msg);
        }
    th_end();

    th_begin("plan: bad shapes and formats are refused with a reason");
    char msg[256];
    kvq_dims bad[] = {{4, 6, 4, 128}, {4, 8, 8, 100}, {4, 8, 8, 512}, {0, 8, 8, 128}};
    for (int i = 0; s && p && i < 4; i++) {
        kvq_status st = plan_build(s, &bad[i], KVQ_F32, p, msg, sizeof msg);
        TH_CHECK(st != KVQ_OK && msg[0], "dims %d/%d/%d/%d accepted", bad[i].layers, bad[i].heads, bad[i].kv_heads,
                 bad[i].head_dim);
    }
    kvq_spec *g64 = spec_text("scheme g { bits 2; per token; group 64; }");
    kvq_dims d96 = {2, 4, 4, 96};
    if (g64 && p)
        TH_CHECK(plan_build(kvq_spec_scheme(g64, NULL), &d96, KVQ_F32, p, msg, sizeof msg) == KVQ_ERR_SHAPE,
                 "group 64 at head_dim 96 accepted");
    kvq_spec_free(g64);
    th_end();
    kvq_free(p);
    kvq_spec_free(sp);
}

static void test_classes_and_emit(void)
{
    th_begin("plan + emit: OTT's layer classes, kernel names, deterministic text");
    kvq_spec *sp = NULL;
    TH_CHECK(kvq_spec_parse_file(th_path("specs/ott.kvq"), &sp) == KVQ_OK, "ott.kvq");
    kvq_plan *p = kvq_malloc(sizeof *p);
    char msg[256];
    kvq_dims d = {6, 32, 8, 128};
    if (sp && p && plan_build(kvq_spec_scheme(sp, NULL), &d, KVQ_F32, p, msg, sizeof msg) == KVQ_OK) {
        TH_CHECK(p->n_classes == 2, "%d classes", p->n_classes);
        TH_CHECK(p->layer_class[0] == p->layer_class[1] && p->layer_class[2] != p->layer_class[1] &&
                     p->layer_class[5] == p->layer_class[2],
                 "layer map");
        const plan_class *deep = &p->cls[p->layer_class[2]], *shallow = &p->cls[p->layer_class[0]];
        TH_CHECK(deep->has_pool && deep->k_hi.masked && !deep->v_hi.masked && !shallow->has_pool &&
                     !shallow->k_hi.masked,
                 "pools and masks");
        emit_cuda_kernel ks[EMIT_CUDA_MAX_KERNELS];
        int n = emit_cuda_kernels(p, ks, EMIT_CUDA_MAX_KERNELS);
        const char *want[] = {"kvq_merge",         "kvq_store_f16",     "kvq_params_sig",    "kvq_ott_compete",
                              "kvq_ott_undo",      "kvq_decode_c0",     "kvq_quant_k_hi_c0", "kvq_quant_v_hi_c0",
                              "kvq_decode_c1",     "kvq_quant_k_hi_c1", "kvq_quant_v_hi_c1"};
        TH_CHECK(n == 11, "%d kernels", n);
        for (int i = 0; i < n && i < 11; i++) TH_CHECK(!strcmp(ks[i].name, want[i]), "kernel %d: %s", i, ks[i].name);
        TH_CHECK(ks[3].kind == EMIT_K_POLICY && ks[3].cls == -1, "policy kernels are common to the plan");
        emit_cuda_text a, b;
        TH_CHECK(emit_cuda_text_build(p, NULL, &a) == KVQ_OK && emit_cuda_text_build(p, NULL, &b) == KVQ_OK, "emit");
        TH_CHECK(a.source_len == b.source_len && !memcmp(a.source, b.source, a.source_len) && !strcmp(a.hash, b.hash),
                 "two emissions differ");
        TH_CHECK(strstr(a.source, "#define KVQ_D 128\n") && strstr(a.source, "#define KVQ_C(name) name##_c1\n") &&
                     !strstr(a.source, "\n#include \"kvq_"),
                 "prelude, class blocks or inlining");
        /* only the policy sections the plan needs: OTT's, not ZipCache's or TailorKV's */
        TH_CHECK(strstr(a.source, "#define KVQ_POL_OTT 1\n") && strstr(a.source, "#define KVQ_POL_ZIP 0\n") &&
                     strstr(a.source, "#define KVQ_POL_TK 0\n") && strstr(a.source, "#define KVQ_POL_DENSE 0\n"),
                 "policy sections");
        TH_CHECK(strstr(a.manifest, a.hash) && strstr(a.header, "kvq_decode_params"), "manifest/header");
        emit_cuda_text_free(&a);
        emit_cuda_text_free(&b);
    }
    kvq_free(p);
    kvq_spec_free(sp);
    th_end();
}

static void test_sha256(void)
{
    th_begin("sha256: FIPS 180-4 test vectors");
    char h[65];
    emit_cuda_sha256_hex("abc", 3, h);
    TH_CHECK(!strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"), "abc: %s", h);
    emit_cuda_sha256_hex("", 0, h);
    TH_CHECK(!strcmp(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"), "empty: %s", h);
    const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    emit_cuda_sha256_hex(m, strlen(m), h);
    TH_CHECK(!strcmp(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"), "448 bits: %s", h);
    th_end();
}

/* Occupancy and bytes in flight (plan_decode_ctas_per_sm, plan_decode_bytes_in_flight): the limits worked by hand
 * for KIVI-2 at head_dim 128, GQA 4 (docs/cuda.md "Load path"), and the load pipeline's parts inside its stages. */
static void test_in_flight(void)
{
    th_begin("plan: CTAs per SM and bytes in flight of KIVI-2 (head_dim 128, GQA 4), by hand");
    kvq_spec *sp = spec_text("scheme k { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } "
                             "residual 128; flush kivi; }");
    kvq_plan *p = kvq_malloc(sizeof *p);
    kvq_dims d = {4, 32, 8, 128};
    char msg[256];
    if (sp && p && plan_build(kvq_spec_scheme(sp, NULL), &d, KVQ_F32, p, msg, sizeof msg) == KVQ_OK) {
        const plan_class *c = &p->cls[0];
        /* 256-token tiles: 3 CTAs an sm_90 SM at their shared memory (plan.c) */
        TH_CHECK(c->stages == 2 && c->tile == 256 && p->threads == 128 && c->kpages == 8, "stages %d tile %d threads %d",
                 c->stages, c->tile, p->threads);
        /* the staged parts and the raw parameter bytes lie inside a stage, the stages before the query */
        TH_CHECK(c->so_kraw >= c->rows_bytes && c->so_vraw >= c->so_kraw + 2 * c->kraws &&
                     c->stage_bytes >= c->so_vraw + 2 * c->vraws && c->so_q >= c->stages * c->stage_bytes &&
                     c->kraws == 8 * 128 * 2 + 64 * 8 && c->vraws == 256 * 4 * 2 + 64,
                 "kraw %d (%d) vraw %d (%d) stage %d q %d", c->so_kraw, c->kraws, c->so_vraw, c->vraws, c->stage_bytes,
                 c->so_q);
        /* integer pages whose scales and zeros are read where cp.async lands them (kpraw, vpraw): no widened
         * floats, the key parameters' part after the stages holds the scores [256][4] (4,096 bytes), the values'
         * 16; p.V's weight fragments share the folded query's part (8 pages' folds of 8 k-blocks x 34 8-byte entries,
         * kvq_mma.cuh KVQ_MMA_KBS: 17,408 bytes); unmasked: 16
         * bytes of mask, no raw mask blocks (docs/cuda.md "Where KIVI-2's shared memory goes"): rows 16,384 + raw
         * 2 x 2,560 + 2 x 2,112 = 25,728 a stage, 76,672 bytes in all (the bias partials 8 pages of 36 floats,
         * kvq_bred_page: 128 bytes more than at 32 floats a page): 3 CTAs an SM on sm_90, 2 on sm_80 */
        TH_CHECK(c->kpraw && c->vpraw && c->par_step == 0 && c->so_kpar == c->stages * c->stage_bytes &&
                     c->so_p == c->so_kpar && c->stage_bytes == 16384 + 2 * c->kraws + 2 * c->vraws &&
                     c->stage_bytes == 25728 && c->so_vpar - c->so_kpar == 256 * 4 * 4 &&
                     c->so_kmask - c->so_vpar == 16 && c->so_q == c->so_kmask + 16 && c->so_w == c->so_qk &&
                     c->so_qsum - c->so_qk == 128 / 16 * 34 * 8 * 8 && c->smem == 76672 && plan_decode_min_blocks(p, c) == 3,
                 "par_step %d kpar %d vpar %d kmask %d q %d qk %d w %d smem %d minb %d", c->par_step, c->so_kpar,
                 c->so_vpar, c->so_kmask, c->so_q, c->so_qk, c->so_w, c->smem, plan_decode_min_blocks(p, c));
        TH_CHECK(plan_decode_ctas_per_sm(p, c, 90, 160) == 3 && plan_decode_ctas_per_sm(p, c, 90, 96) == 3 &&
                     plan_decode_ctas_per_sm(p, c, 80, 128) == 2,
                 "ctas %d %d %d", plan_decode_ctas_per_sm(p, c, 90, 160), plan_decode_ctas_per_sm(p, c, 90, 96),
                 plan_decode_ctas_per_sm(p, c, 80, 128));
        /* registers in units of 256 a warp: 168 -> 5376 a warp, 21504 a CTA, 3 in 64K; 169 -> 5632, 2 */
        const int sm90 = (228 * 1024) / (c->smem + 1024), sm80 = (164 * 1024) / (c->smem + 1024);
        TH_CHECK(plan_decode_ctas_per_sm(p, c, 90, 168) == (sm90 < 3 ? sm90 : 3) &&
                     plan_decode_ctas_per_sm(p, c, 90, 169) == (sm90 < 2 ? sm90 : 2) &&
                     plan_decode_ctas_per_sm(p, c, 80, 64) == (sm80 < 16 ? sm80 : 16) &&
                     plan_decode_ctas_per_sm(p, c, 90, 0) == (sm90 < 16 ? sm90 : 16),
                 "smem %d: ctas %d %d %d", c->smem, plan_decode_ctas_per_sm(p, c, 90, 168),
                 plan_decode_ctas_per_sm(p, c, 90, 169), plan_decode_ctas_per_sm(p, c, 80, 64));
        /* a KIVI-2 token of one kv head: 32 + 32 code bytes, 2 x 2 B per-channel parameters over 32 tokens... the
         * plan's own count, times the tile, the stages and the CTAs */
        const double tb = 256 * plan_body_bytes_per_token(p, c);
        TH_CHECK(plan_decode_tile_bytes(p, c, 0) == tb && plan_decode_tile_bytes(p, c, 100) == tb / 256 * 100 &&
                     plan_decode_bytes_in_flight(p, c, 90, 168, 0) == 2 * tb * plan_decode_ctas_per_sm(p, c, 90, 168),
                 "tile bytes %g in flight %g", plan_decode_tile_bytes(p, c, 0),
                 plan_decode_bytes_in_flight(p, c, 90, 168, 0));
        /* issue 22: at least 24 KiB in flight per SM on sm_90 at the registers ptxas gives (168, docs/cuda.md) */
        TH_CHECK(plan_decode_bytes_in_flight(p, c, 90, 168, 0) >= 24 * 1024, "%g bytes in flight on sm_90",
                 plan_decode_bytes_in_flight(p, c, 90, 168, 0));
    } else
        TH_CHECK(0, "plan: %s", msg);
    kvq_free(p);
    kvq_spec_free(sp);
    th_end();
}

/* $KVQ_DECODE_MINB (docs/cuda.md "Tuning knobs"): the quantized classes' __launch_bounds__ blocks, in the unit;
 * the fp16 classes keep the plan's; not a number from 0 to 32: refused with the variable named. */
static void test_minb_knob(void)
{
    th_begin("plan: KVQ_DECODE_MINB sets the quantized decode kernels' blocks per SM, and is checked");
    kvq_spec *sp = spec_text("scheme k { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } "
                             "residual 128; flush kivi; layers 1 { bits 16; } }");
    kvq_plan *p = kvq_malloc(sizeof *p);
    kvq_dims d = {4, 32, 8, 128};
    char msg[256] = "";
    const kvq_scheme *s = sp ? kvq_spec_scheme(sp, NULL) : NULL;
    TH_CHECK(s && p, "spec");
    if (s && p && setenv("KVQ_DECODE_MINB", "5", 1) == 0) {
        kvq_status st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
        TH_CHECK(st == KVQ_OK && p->decode_minb == 5 && p->n_classes == 2, "%s", msg);
        if (st == KVQ_OK && p->n_classes == 2) {
            const int q = p->cls[0].quant && p->cls[0].k_hi.bits == 2 ? 0 : 1;
            TH_CHECK(plan_decode_min_blocks(p, &p->cls[q]) == 5 && plan_decode_min_blocks(p, &p->cls[1 - q]) <= 3,
                     "minb %d / %d", plan_decode_min_blocks(p, &p->cls[q]), plan_decode_min_blocks(p, &p->cls[1 - q]));
            char *src = NULL;
            TH_CHECK(emit_cuda_source(p, &src, NULL) == KVQ_OK && src && strstr(src, "#define KVQ_C_MINB 5\n"),
                     "the unit has no KVQ_C_MINB 5");
            kvq_free(src);
            TH_CHECK(plan_check_target(p, 90, msg, sizeof msg) == KVQ_OK, "%s", msg);
        }
        setenv("KVQ_DECODE_MINB", "4x", 1);
        st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
        TH_CHECK(st == KVQ_ERR_INVALID && strstr(msg, "KVQ_DECODE_MINB"), "accepted 4x: %s", msg);
        unsetenv("KVQ_DECODE_MINB");
        st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
        TH_CHECK(st == KVQ_OK && p->decode_minb == 0, "%s", msg);
    }
    kvq_free(p);
    kvq_spec_free(sp);
    th_end();
}

/* $KVQ_DECODE_TILE (docs/cuda.md "Tuning knobs"): the tile of the classes whose pages hold codes, in the unit, the
 * key pages a tile spans and the shared memory following it; fp16 classes keep the plan's; anything but 0, 32, 64,
 * 128 or 256: refused with the variable named. */
static void test_tile_knob(void)
{
    th_begin("plan: KVQ_DECODE_TILE sets the quantized decode tile, and is checked");
    kvq_spec *sp = spec_text("scheme k { key { bits 2; per channel; group 32; } value { bits 2; per token; group 32; } "
                             "residual 128; flush kivi; layers 1 { bits 16; } }");
    kvq_plan *p = kvq_malloc(sizeof *p), *p0 = kvq_malloc(sizeof *p0);
    kvq_dims d = {4, 32, 8, 128};
    char msg[256] = "";
    const kvq_scheme *s = sp ? kvq_spec_scheme(sp, NULL) : NULL;
    TH_CHECK(s && p && p0, "spec");
    if (s && p && p0 && plan_build(s, &d, KVQ_F32, p0, msg, sizeof msg) == KVQ_OK &&
        setenv("KVQ_DECODE_TILE", "128", 1) == 0) {
        kvq_status st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
        TH_CHECK(st == KVQ_OK && p->decode_tile == 128 && p->n_classes == 2, "%s", msg);
        if (st == KVQ_OK && p->n_classes == 2) {
            const int q = p->cls[0].quant && p->cls[0].k_hi.bits == 2 ? 0 : 1;
            const plan_class *c = &p->cls[q], *c0 = &p0->cls[q], *f = &p->cls[1 - q], *f0 = &p0->cls[1 - q];
            TH_CHECK(c0->tile == 256 && c->tile == 128 && c0->kpages == 8 && c->kpages == 4,
                     "tile %d -> %d, key pages %d -> %d", c0->tile, c->tile, c0->kpages, c->kpages);
            /* the fp16 rows of the quantized class fill its smaller stage; the fp16 class is untouched */
            TH_CHECK(plan_tile_tokens(c, 1, 1) == 16 && plan_tile_tokens(c0, 1, 1) == 32, "fp16 rows %d, %d",
                     plan_tile_tokens(c, 1, 1), plan_tile_tokens(c0, 1, 1));
            TH_CHECK(f->tile == f0->tile && f->smem == f0->smem, "fp16 class: tile %d smem %d", f->tile, f->smem);
            TH_CHECK(c->smem < c0->smem && 2 * c->rows_bytes == c0->rows_bytes, "smem %d -> %d, rows %d -> %d",
                     c0->smem, c->smem, c0->rows_bytes, c->rows_bytes);
            char *src = NULL;
            TH_CHECK(emit_cuda_source(p, &src, NULL) == KVQ_OK && src && strstr(src, "#define KVQ_C_TILE 128\n"),
                     "the unit has no KVQ_C_TILE 128");
            kvq_free(src);
            TH_CHECK(plan_check_target(p, 90, msg, sizeof msg) == KVQ_OK, "%s", msg);
        }
        const char *bad[] = {"96", "512", "128x", "-128"};
        for (int i = 0; i < 4; i++) {
            setenv("KVQ_DECODE_TILE", bad[i], 1);
            st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
            TH_CHECK(st == KVQ_ERR_INVALID && strstr(msg, "KVQ_DECODE_TILE"), "accepted %s: %s", bad[i], msg);
        }
        unsetenv("KVQ_DECODE_TILE");
        st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
        TH_CHECK(st == KVQ_OK && p->decode_tile == 0 && p->cls[0].tile == p0->cls[0].tile, "%s", msg);
    }
    unsetenv("KVQ_DECODE_TILE");
    kvq_free(p), kvq_free(p0);
    kvq_spec_free(sp);
    th_end();
}

int main(void)
{
    unsetenv("KVQ_DECODE_MINB");
    unsetenv("KVQ_DECODE_TILE");
    test_layout();
    test_mapping();
    test_in_flight();
    test_minb_knob();
    test_tile_knob();
    test_classes_and_emit();
    test_sha256();
    return th_summary();
}
