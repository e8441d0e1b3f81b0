/* kvqc build --cost (docs/cuda.md, "Cost model") against the runtime: the tiles the model counted (its profile
 * of a real decode step under the emulator) must be the tiles the runtime produces for that step -- its own list,
 * rt_step_tiles (runtime/rt_tiles.c: what the layer's last decode step read) on the emu backend, split for the
 * same SM count -- in number per (sequence, kv head) and in mean tokens. A model whose tile lengths differ from
 * the runtime's (the plan's 128 where pages cut tiles shorter, or the reverse) fails here. Also: the row parses, per_byte = per_token / bytes,
 * and the executed total is that of a real run (more than the tiles' tokens). Skips without libnvrtc, nvdisasm,
 * addr2line or objdump. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/cu.h"
#include "harness.h"
#include "kvq.h"
#include "rt_internal.h"
#include "sass_cost.h"

#define TOKENS 300

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = calloc(1, 1 << 16);
    size_t n = buf ? fread(buf, 1, (1 << 16) - 1, f) : 0;
    if (buf) buf[n] = '\0';
    fclose(f);
    return buf;
}

/* The runtime's tiles for the step kvqc's cost model runs (tools/kvqc/cost.c, run_step): 32 layers, 32 / 8
 * heads, head_dim 128, fp32, one sequence of TOKENS prefilled tokens, one decode step of layer 0. */
static int runtime_tiles(const char *spec, int *n_tiles, int *tokens)
{
    kvq_spec *sp = NULL;
    if (kvq_spec_parse_file(spec, &sp) != KVQ_OK) return -1;
    kvq_engine_config cfg;
    kvq_engine_config_init(&cfg);
    cfg.backend = KVQ_BACKEND_EMU;
    cfg.dtype = KVQ_F32;
    cfg.dims.layers = 32, cfg.dims.heads = 32, cfg.dims.kv_heads = 8, cfg.dims.head_dim = 128;
    kvq_engine *e = NULL;
    kvq_seq *s = NULL;
    char err[512];
    int rc = -1;
    const size_t nkv = (size_t)8 * TOKENS * 128, nq = (size_t)32 * TOKENS * 128;
    float *k = calloc(nkv, sizeof *k), *v = calloc(nkv, sizeof *v), *q = calloc(nq, sizeof *q);
    float *out = calloc(32 * 128, sizeof *out);
    if (!k || !v || !q || !out) goto done;
    for (size_t i = 0; i < nkv; i++) k[i] = (float)((i * 7919) % 1000) / 500.0f - 1.0f, v[i] = -k[i];
    if (kvq_engine_create(kvq_spec_scheme_at(sp, 0), &cfg, &e, err, sizeof err) != KVQ_OK) {
        printf("note: %s\n", err);
        goto done;
    }
    if (kvq_seq_create(e, &s) != KVQ_OK) goto done;
    kvq_prefill_item pi = {s, TOKENS, k, v, q};
    if (kvq_prefill(e, 0, &pi, 1) != KVQ_OK) goto done;
    kvq_decode_item di = {s, k, v, q, out};
    if (kvq_decode(e, 0, &di, 1) != KVQ_OK) goto done;
    kvq_tile_info t[64];
    int nt = 0;
    if (rt_step_tiles(e, s, 0, t, 64, &nt) != KVQ_OK) goto done;
    if (nt > 64) {
        printf("note: %d tiles, more than the test's 64\n", nt);
        goto done;
    }
    int toks = 0;
    for (int i = 0; i < nt; i++) toks += t[i].n;
    *n_tiles = nt, *tokens = toks;
    rc = 0;
done:
    if (rc) printf("note: %s\n", e ? kvq_engine_errmsg(e) : "no engine");
    kvq_engine_free(e);
    kvq_spec_free(sp);
    free(k), free(v), free(q), free(out);
    return rc;
}

typedef struct {
    char fn[64], arch[16], target[16], fl[8];
    int batch, gqa, tokens, regs, smem, ctas;
    double per_tok, bytes, per_byte, inflight, tiles, tile_tok, merge, executed;
} cost_row;

/* The rows of DIR/NAME/cost.txt (at most cap); -1 when a row does not parse or the file is missing. */
static int read_rows(const char *dir, const char *name, cost_row *r, int cap)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s/cost.txt", dir, name);
    char *txt = slurp(path);
    if (!txt) return -1;
    int n = 0;
    for (char *l = strtok(txt, "\n"); l && n >= 0; l = strtok(NULL, "\n")) {
        if (l[0] == '#' || !strncmp(l, "kernel", 6)) continue;
        if (n == cap) break;
        cost_row *x = &r[n];
        int k = sscanf(l, "%63s %15s %d %d %d %lf %lf %lf %15s %d %d %d %lf %7s %lf %lf %lf %lf", x->fn, x->arch,
                       &x->batch, &x->gqa, &x->tokens, &x->per_tok, &x->bytes, &x->per_byte, x->target, &x->regs,
                       &x->smem, &x->ctas, &x->inflight, x->fl, &x->tiles, &x->tile_tok, &x->merge, &x->executed);
        if (k != 18) {
            printf("note: row does not parse (%d fields): %s\n", k, l);
            n = -1;
            break;
        }
        n++;
    }
    free(txt);
    return n;
}

/* kvqc build SPEC --arch sm_90 -o DIR --cost --cost-tokens T EXTRA: 0 ok */
static int run_kvqc(const char *kvqc, const char *spec, const char *dir, int tokens, const char *extra)
{
    char cmd[2 * PATH_MAX], path[PATH_MAX];
    snprintf(cmd, sizeof cmd, "'%s' build %s --arch sm_90 -o %s --cost --cost-tokens %d %s >/dev/null 2>%s/err", kvqc,
             spec, dir, tokens, extra, dir);
    int st = system(cmd);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
    snprintf(path, sizeof path, "%s/err", dir);
    char *err = slurp(path);
    printf("note: kvqc build --cost failed (%d): %.300s\n", st, err ? err : "");
    free(err);
    return -1;
}

static void remove_dir(const char *dir)
{
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
}

int main(int argc, char **argv)
{
    (void)argc;
    char kvqc[PATH_MAX], why[512], *slash;
    if (!realpath(argv[0], kvqc)) snprintf(kvqc, sizeof kvqc, "%s", argv[0]);
    for (int i = 0; i < 2; i++)
        if ((slash = strrchr(kvqc, '/'))) *slash = '\0';
    strncat(kvqc, "/kvqc", sizeof kvqc - strlen(kvqc) - 1);
    if (chdir(th_srcdir()) != 0 || access(kvqc, X_OK) != 0) {
        printf("FAIL cost model: no kvqc at %s or no source directory\n", kvqc);
        return 1;
    }
    const char *tool = getenv("KVQ_NVDISASM");
    int have = tool && *tool ? access(tool, X_OK) == 0 : access("build/sass-tools/nvdisasm", X_OK) == 0;
    if (cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        printf("SKIP cost model: %s\n", why);
        return th_summary();
    }
    if (!have || system("command -v addr2line >/dev/null 2>&1 && command -v objdump >/dev/null 2>&1") != 0) {
        printf("SKIP cost model: no nvdisasm (tools/ensure-sass-tools.sh) or no binutils\n");
        return th_summary();
    }
    const char *specs[] = {"specs/kivi2.kvq", "specs/fp16.kvq"};
    const char *names[] = {"kivi2", "fp16"};
    const char *targets[] = {"0.35:", "0.20:"};
    for (int si = 0; si < 2; si++) {
        th_begin("cost model, %s: the tiles it counted are the runtime's (%d tokens + 1)", names[si], TOKENS);
        char dir[] = "/tmp/kvq_test_cost_XXXXXX";
        TH_CHECK(mkdtemp(dir) != NULL, "mkdtemp");
        TH_CHECK(run_kvqc(kvqc, specs[si], dir, TOKENS, "") == 0, "kvqc build --cost failed");
        cost_row r[4];
        memset(r, 0, sizeof r);
        int rows = read_rows(dir, names[si], r, 4);
        TH_CHECK(rows == 1, "%d rows", rows);
        const cost_row *x = &r[0];
        TH_CHECK(x->batch == 1 && x->gqa == 4 && x->tokens == TOKENS && x->regs > 0 && x->ctas > 0 && x->inflight > 0,
                 "row %s %s", x->fn, x->arch);
        TH_CHECK(x->per_byte > 0 && x->per_byte - x->per_tok / x->bytes < 1e-3 && x->per_tok / x->bytes - x->per_byte < 1e-3,
                 "per_byte %.3f", x->per_byte);
        /* the verdict is the comparison with the scheme's bound (fp16 0.2, quantized at GQA 4 0.35): FAIL over it,
         * near under it by less than the model's margin (SASS_COST_MARGIN), else pass; the row's figures are
         * rounded (per_token to 0.1), so within that of either edge both verdicts beside it are the row's */
        const double bound = si == 0 ? 0.35 : 0.2, pb = x->per_tok / x->bytes, round = 0.05 / x->bytes + 1e-9;
        const char *want = pb > bound ? "FAIL" : pb * SASS_COST_MARGIN > bound ? "near" : "pass";
        const int edge_fail = pb > bound - round && pb < bound + round;
        const int edge_near = pb * SASS_COST_MARGIN > bound - round && pb * SASS_COST_MARGIN < bound + round;
        TH_CHECK(!strncmp(x->target, targets[si], 5) &&
                     (!strcmp(x->target + 5, want) ||
                      (edge_fail && (!strcmp(x->target + 5, "near") || !strcmp(x->target + 5, "FAIL"))) ||
                      (edge_near && (!strcmp(x->target + 5, "pass") || !strcmp(x->target + 5, "near")))),
                 "target %s at %.3f / B (%s)", x->target, x->per_byte, want);
        TH_CHECK(!strcmp(x->fl, x->inflight >= 24576 ? "pass" : "FAIL"), "in flight %.0f: %s", x->inflight, x->fl);
        int nt = 0, toks = 0;
        setenv("KVQ_EMU_SMS", "132", 1);
        TH_CHECK(runtime_tiles(specs[si], &nt, &toks) == 0, "the runtime's step failed");
        unsetenv("KVQ_EMU_SMS");
        TH_CHECK(toks == TOKENS + 1, "the runtime's tiles hold %d tokens", toks);
        TH_CHECK(nt > 0 && x->tiles > nt - 0.05 && x->tiles < nt + 0.05, "model: %.2f tiles, runtime: %d", x->tiles, nt);
        TH_CHECK(x->tile_tok > (double)toks / nt - 0.1 && x->tile_tok < (double)toks / nt + 0.1,
                 "model: %.1f tokens a tile, runtime: %.1f", x->tile_tok, (double)toks / nt);
        /* every token's q.K and p.V is at least one warp-instruction of some warp: a real run, not a plan */
        TH_CHECK(x->executed > 8.0 * (TOKENS + 1), "executed %.0f", x->executed);
        remove_dir(dir);
        th_end();
    }
    /* the batch: one sequence's blocks run for all (sampled) against every sequence's prefill and blocks run */
    th_begin("cost model, kivi2: batch 3 counted from one sequence equals batch 3 run whole (%d tokens + 1)", TOKENS);
    {
        char d1[] = "/tmp/kvq_test_cost_XXXXXX", d2[] = "/tmp/kvq_test_cost_XXXXXX";
        TH_CHECK(mkdtemp(d1) != NULL && mkdtemp(d2) != NULL, "mkdtemp");
        TH_CHECK(run_kvqc(kvqc, specs[0], d1, TOKENS, "--cost-batch 3") == 0, "kvqc build --cost (sampled) failed");
        TH_CHECK(run_kvqc(kvqc, specs[0], d2, TOKENS, "--cost-batch 3 --cost-every-block") == 0,
                 "kvqc build --cost --cost-every-block failed");
        cost_row a[2], b[2];
        memset(a, 0, sizeof a), memset(b, 0, sizeof b);
        int na = read_rows(d1, names[0], a, 2), nb = read_rows(d2, names[0], b, 2);
        TH_CHECK(na == 1 && nb == 1, "%d and %d rows", na, nb);
        TH_CHECK(a[0].batch == 3 && b[0].batch == 3, "batch %d, %d", a[0].batch, b[0].batch);
        TH_CHECK(a[0].executed == b[0].executed, "sampled: %.0f warp-instructions, every block: %.0f", a[0].executed,
                 b[0].executed);
        TH_CHECK(a[0].tiles == b[0].tiles && a[0].merge == b[0].merge, "tiles %.2f / %.2f, merge %.2f / %.2f",
                 a[0].tiles, b[0].tiles, a[0].merge, b[0].merge);
        remove_dir(d1);
        remove_dir(d2);
    }
    th_end();
    return th_summary();
}
