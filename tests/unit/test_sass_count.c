/* kvqc build's issue count (docs/cuda.md, "Issue count"): the SASS loop counter on hand-written SASS (the
 * longest path through a branching loop body, the innermost loop holding the token reduction, no loop), then
 * `kvqc build` on specs/kivi2.kvq: instructions.txt exists and each row parses and is consistent. The second
 * part skips without libnvrtc or cuobjdump (tools/ensure-sass-tools.sh installs it under build/). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/cu.h"
#include "harness.h"
#include "sass_count.h"

#define L(a, text) "        /*" a "*/                   " text " ;   /* 0x0000000000000000 */\n" \
                   "                                                                  /* 0x000fe20000000000 */\n"

/* outer loop 0x0010..0x00c0 (no shuffle); inner loop 0x0030..0x00a0 with a branch skipping two instructions */
static const char sass_two_loops[] =
    "\tcode for sm_90\n\t\tFunction : k\n"
    L("0000", "MOV R1, c[0x0][0x28]")
    L("0010", "IADD3 R2, R2, 0x1, RZ")
    L("0020", "MOV R3, RZ")
    L("0030", "LDS R4, [R3]")
    L("0040", "SHFL.BFLY PT, R5, R4, 0x1, 0x1f")
    L("0050", "@P0 BRA 0x80")
    L("0060", "FFMA R6, R5, R5, R6")
    L("0070", "FFMA R6, R5, R5, R6")
    L("0080", "MUFU.EX2 R7, R6")
    L("0090", "ISETP.GE.AND P1, PT, R3, R8, PT")
    L("00a0", "@!P1 BRA 0x30")
    L("00b0", "ISETP.GE.AND P2, PT, R2, R9, PT")
    L("00c0", "@!P2 BRA 0x10")
    L("00d0", "EXIT")
    L("00e0", "BRA 0xe0")
    L("00f0", "NOP")
    "\t\t..........\n";

/* a marked loop 0x10..0x60 whose shuffle has a divergent slow path (BRA.DIV to WARPSYNC.COLLECTIVE code past the
 * exit, which branches back into the loop): the count follows the converged path */
static const char sass_div[] =
    "\t\tFunction : k\n"
    L("0000", "MOV R1, c[0x0][0x28]")
    L("0010", "PMTRIG 0x2")
    L("0020", "FFMA R6, R5, R5, R6")
    L("0030", "BRA.DIV UR4, 0xa0")
    L("0040", "SHFL.BFLY PT, R5, R4, 0x1, 0x1f")
    L("0050", "FFMA R6, R5, R5, R6")
    L("0060", "@!P1 BRA 0x10")
    L("0070", "EXIT")
    L("0080", "BRA 0x80")
    L("0090", "NOP")
    L("00a0", "WARPSYNC.COLLECTIVE R76, 0xc0")
    L("00b0", "SHFL.BFLY P0, R78, R81, R80, R83")
    L("00c0", "ENDCOLLECTIVE")
    L("00d0", "MOV R5, R78")
    L("00e0", "BRA 0x50")
    "\t\t..........\n";

static const char sass_no_loop[] = "\t\tFunction : k\n" L("0000", "SHFL.BFLY PT, R5, R4, 0x1, 0x1f") L("0010", "EXIT");

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

int main(int argc, char **argv)
{
    (void)argc;
    sass_loop_count c;

    th_begin("sass count: the innermost loop with the reduction, its longest path, NOPs and other loops aside");
    TH_CHECK(sass_count_token_loop(sass_two_loops, "k", &c) == 0, "no loop found");
    /* 0x30..0xa0 is 8 instructions, all on the path that does not take the branch at 0x50 */
    TH_CHECK(c.instructions == 8, "instructions %d", c.instructions);
    TH_CHECK(c.header == 0x30 && c.latch == 0xa0, "loop %#x..%#x", c.header, c.latch);
    TH_CHECK(c.candidates == 2, "candidates %d (the outer loop holds the shuffle too)", c.candidates);
    TH_CHECK(c.fp32 == 2 && c.shfl == 1 && c.mufu == 1 && c.lds == 1, "kinds %d %d %d %d", c.fp32, c.shfl, c.mufu,
             c.lds);
    th_end();

    th_begin("sass count: a BRA.DIV slow path past the exit is not part of the loop");
    TH_CHECK(sass_count_marked_loop(sass_div, "k", 1, &c) == 0, "no marked loop found");
    /* PMTRIG (not counted), FFMA, BRA.DIV, SHFL, FFMA, BRA */
    TH_CHECK(c.instructions == 5 && c.header == 0x10 && c.latch == 0x60, "instructions %d, loop %#x..%#x",
             c.instructions, c.header, c.latch);
    th_end();

    th_begin("sass count: no loop, or no such function, is reported as not found");
    TH_CHECK(sass_count_token_loop(sass_no_loop, "k", &c) == 1, "a loop in straight code");
    TH_CHECK(sass_count_token_loop(sass_two_loops, "other", &c) == 1, "found a missing function");
    th_end();

    /* kvqc build on a real spec */
    char kvqc[PATH_MAX], why[512], *slash;
    if (!realpath(argv[0], kvqc)) snprintf(kvqc, sizeof kvqc, "%s", argv[0]);
    for (int i = 0; i < 2; i++)
        if ((slash = strrchr(kvqc, '/'))) *slash = '\0';
    strncat(kvqc, "/kvqc", sizeof kvqc - strlen(kvqc) - 1);
    if (chdir(th_srcdir()) != 0 || access(kvqc, X_OK) != 0) {
        printf("FAIL kvqc build count: no kvqc at %s or no source directory\n", kvqc);
        return 1;
    }
    const char *tool = getenv("KVQ_CUOBJDUMP");
    int have_tool = tool && *tool ? access(tool, X_OK) == 0 : access("build/sass-tools/cuobjdump", X_OK) == 0;
    if (cu_nvrtc_load(why, sizeof why) != KVQ_OK) {
        printf("SKIP kvqc build count: %s\n", why);
    } else if (!have_tool) {
        printf("SKIP kvqc build count: no cuobjdump (run tools/ensure-sass-tools.sh)\n");
    } else {
        th_begin("kvqc build: instructions.txt has a parsable, consistent row per decode kernel and arch");
        char dir[] = "/tmp/kvq_test_sass_XXXXXX", cmd[2 * PATH_MAX], path[PATH_MAX];
        TH_CHECK(mkdtemp(dir) != NULL, "mkdtemp");
        snprintf(cmd, sizeof cmd, "'%s' build specs/kivi2.kvq --arch sm_90 -o %s >/dev/null 2>&1", kvqc, dir);
        int st = system(cmd);
        TH_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "kvqc build failed (%d)", st);
        snprintf(path, sizeof path, "%s/kivi2/instructions.txt", dir);
        char *txt = slurp(path);
        TH_CHECK(txt != NULL, "no %s", path);
        int rows = 0;
        for (char *l = txt ? strtok(txt, "\n") : NULL; l; l = strtok(NULL, "\n")) {
            if (l[0] == '#' || !strncmp(l, "kernel", 6)) continue;
            char fn[64], arch[16];
            double per_tok, bytes, per_byte, part[4];
            int n = sscanf(l, "%63s %15s %lf %lf %lf %lf %lf %lf %lf", fn, arch, &per_tok, &bytes, &per_byte, &part[0],
                           &part[1], &part[2], &part[3]);
            TH_CHECK(n == 9, "row does not parse: %s", l);
            if (n != 9) continue;
            rows++;
            TH_CHECK(!strcmp(fn, "kvq_decode_c0") && !strcmp(arch, "sm_90"), "row %s %s", fn, arch);
            /* per token = scores + probabilities + values + the tile loop's own share, each printed to 0.1 */
            double sum = part[0] + part[1] + part[2] + part[3];
            TH_CHECK(per_tok > 1.0 && per_tok - sum < 0.25 && sum - per_tok < 0.25, "per_token %.1f, parts %.1f",
                     per_tok, sum);
            TH_CHECK(part[0] > 0.0 && part[2] > 0.0, "scores %.1f values %.1f", part[0], part[2]);
            /* KIVI-2 at head_dim 128: K 32 code bytes + 128 x 4 / 32 per-channel, V 32 + 4 groups x 4 */
            TH_CHECK(bytes == 96.0, "bytes %.2f, expected 96", bytes);
            TH_CHECK(per_byte > 0.0 && per_byte < 10.0 && (per_byte - per_tok / bytes) < 1e-3 &&
                         (per_tok / bytes - per_byte) < 1e-3,
                     "per_byte %.3f", per_byte);
        }
        TH_CHECK(rows == 1, "%d rows", rows);
        free(txt);
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
        th_end();
    }
    return th_summary();
}
