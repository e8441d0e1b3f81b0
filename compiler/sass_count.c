/* kvqc build's static issue count of the decode kernels (docs/cuda.md, "Issue count"): the SASS of one kernel
 * (cuobjdump -sass text) -> basic blocks -> natural loops -> the token loop -> instructions of one iteration.
 *
 * The token loop is the innermost loop that holds the per-token reduction (SHFL.BFLY) or the tensor-core
 * products (HMMA). One iteration is the longest path from the loop header to its back edge: the body branches
 * only where a lane has no work (a token past the end, an idle lane), and the steady state does all the work.
 * Instructions are counted as issued per warp: every SASS instruction but NOP. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "sass_count.h"

typedef struct {
    unsigned addr;
    char op[24];  /* opcode with its modifiers, e.g. FFMA, SHFL.BFLY, LDS.128 */
    int pred;     /* guarded by a predicate other than PT */
    int branch;   /* BRA */
    int exit;     /* EXIT, RET */
    unsigned target;
} sass_ins;

typedef struct {
    int first, last; /* instruction indices, inclusive */
    int succ[2], n_succ;
} sass_block;

/* One instruction line: address comment, optional predicate, opcode, operands, then the encoding comment
 * (e.g. "/\*0a80*\/  @!P0 BRA 0x1b20 ;"). 0 when the line holds no instruction. */
static int parse_line(const char *line, sass_ins *in)
{
    const char *s = strstr(line, "/*");
    if (!s) return 0;
    char *end;
    unsigned long a = strtoul(s + 2, &end, 16);
    if (end == s + 2 || strncmp(end, "*/", 2) != 0) return 0;
    s = end + 2;
    while (*s == ' ' || *s == '\t') s++;
    if (*s == '\0' || *s == '/') return 0; /* the encoding's second line */
    memset(in, 0, sizeof *in);
    in->addr = (unsigned)a;
    if (*s == '@') {
        in->pred = strncmp(s, "@PT ", 4) != 0;
        while (*s && *s != ' ') s++;
        while (*s == ' ') s++;
    }
    size_t n = strcspn(s, " ;");
    if (n == 0) return 0;
    if (n >= sizeof in->op) n = sizeof in->op - 1;
    memcpy(in->op, s, n);
    in->op[n] = '\0';
    /* BRA.DIV leaves for the slow path of a warp collective when the warp is diverged (WARPSYNC.COLLECTIVE
     * sequences placed after the function's exit, which branch back): the decode loops run converged, so the
     * count follows the fall-through and ignores that region */
    if (!strcmp(in->op, "BRA") || (!strncmp(in->op, "BRA.", 4) && strcmp(in->op, "BRA.DIV"))) {
        const char *t = strstr(s + n, "0x");
        if (!t) return 0;
        in->branch = 1;
        in->target = (unsigned)strtoul(t, NULL, 16);
    }
    if (!strcmp(in->op, "PMTRIG")) {
        const char *t = strstr(s + n, "0x");
        in->target = t ? (unsigned)strtoul(t, NULL, 16) : 0;
    }
    in->exit = !strcmp(in->op, "EXIT") || !strncmp(in->op, "RET", 3);
    return 1;
}

/* The instructions of `fn` in `sass` (cuobjdump -sass of one cubin). Returns the count, -1 on no memory. */
static int parse_function(const char *sass, const char *fn, sass_ins **out)
{
    *out = NULL;
    char header[256];
    snprintf(header, sizeof header, "Function : %s\n", fn);
    const char *s = strstr(sass, header);
    if (!s) return 0;
    s += strlen(header);
    int n = 0, cap = 0;
    sass_ins *v = NULL;
    while (*s) {
        const char *e = strchr(s, '\n');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        char line[512];
        if (len >= sizeof line) len = sizeof line - 1;
        memcpy(line, s, len);
        line[len] = '\0';
        if (strstr(line, "Function : ") || strstr(line, ".section")) break;
        sass_ins in;
        if (parse_line(line, &in) && strcmp(in.op, "NOP") != 0) {
            if (n == cap) {
                int nc = cap ? 2 * cap : 1024;
                sass_ins *w = kvq_realloc(v, (size_t)nc * sizeof *v);
                if (!w) {
                    kvq_free(v);
                    return -1;
                }
                v = w, cap = nc;
            }
            v[n++] = in;
        }
        if (!e) break;
        s = e + 1;
    }
    *out = v;
    return n;
}

static int block_of(const sass_block *b, int nb, const sass_ins *in, unsigned addr)
{
    for (int i = 0; i < nb; i++)
        if (in[b[i].first].addr <= addr && addr <= in[b[i].last].addr) return in[b[i].first].addr == addr ? i : -1;
    return -1;
}

/* mark 0: the token reduction or tensor-core products; mark k > 0: the marker KVQ_MARK(k) (pmevent k, which
 * SASS writes PMTRIG 1 << k) */
static int is_wanted(const sass_ins *in, int mark)
{
    if (mark == 0) return !strncmp(in->op, "SHFL.BFLY", 9) || !strncmp(in->op, "HMMA", 4);
    return !strcmp(in->op, "PMTRIG") && in->target == (1u << mark);
}

static int count_loop(const char *sass, const char *fn, int mark, sass_loop_count *out);

int sass_count_token_loop(const char *sass, const char *fn, sass_loop_count *out)
{
    return count_loop(sass, fn, 0, out);
}

int sass_count_marked_loop(const char *sass, const char *fn, int mark, sass_loop_count *out)
{
    return count_loop(sass, fn, mark, out);
}

static int count_loop(const char *sass, const char *fn, int mark, sass_loop_count *out)
{
    memset(out, 0, sizeof *out);
    sass_ins *in;
    int n = parse_function(sass, fn, &in);
    if (n <= 0) return n < 0 ? -1 : 1;
    int rc = 1;
    char *leader = kvq_calloc((size_t)n + 1, 1);
    sass_block *b = kvq_calloc((size_t)n, sizeof *b);
    int *inloop = kvq_calloc((size_t)n, sizeof *inloop), *stack = kvq_calloc((size_t)n, sizeof *stack);
    long *best = kvq_calloc((size_t)n, sizeof *best);
    if (!leader || !b || !inloop || !stack || !best) {
        rc = -1;
        goto done;
    }
    /* basic blocks: leaders are the entry, branch targets and what follows a branch or an exit */
    leader[0] = 1;
    for (int i = 0; i < n; i++) {
        if (in[i].branch)
            for (int j = 0; j < n; j++)
                if (in[j].addr == in[i].target) leader[j] = 1;
        if (in[i].branch || in[i].exit) leader[i + 1] = 1;
    }
    int nb = 0;
    for (int i = 0; i < n; i++) {
        if (leader[i]) b[nb++].first = i;
        b[nb - 1].last = i;
    }
    for (int k = 0; k < nb; k++) {
        const sass_ins *t = &in[b[k].last];
        int falls = !(t->branch || t->exit) || t->pred;
        if (t->branch) {
            int s = block_of(b, nb, in, t->target);
            if (s >= 0) b[k].succ[b[k].n_succ++] = s;
        }
        if (falls && k + 1 < nb) b[k].succ[b[k].n_succ++] = k + 1;
    }
    /* natural loops of the back edges u -> h (h at or before u); keep the smallest holding a token op */
    int best_size = 0, best_h = -1, best_u = -1, candidates = 0;
    for (int u = 0; u < nb; u++)
        for (int e = 0; e < b[u].n_succ; e++) {
            int h = b[u].succ[e];
            if (h > u) continue;
            memset(inloop, 0, (size_t)nb * sizeof *inloop);
            inloop[h] = 1;
            int sp = 0, size = 1, has_tok = 0;
            if (!inloop[u]) inloop[u] = 1, stack[sp++] = u, size++;
            while (sp) {
                int x = stack[--sp];
                for (int p = 0; p < nb; p++)
                    for (int f = 0; f < b[p].n_succ; f++)
                        if (b[p].succ[f] == x && !inloop[p]) inloop[p] = 1, stack[sp++] = p, size++;
            }
            for (int k = 0; k < nb && !has_tok; k++)
                if (inloop[k])
                    for (int i = b[k].first; i <= b[k].last && !has_tok; i++) has_tok = is_wanted(&in[i], mark);
            if (!has_tok) continue;
            candidates++;
            if (best_h < 0 || size < best_size) best_size = size, best_h = h, best_u = u;
        }
    if (best_h < 0) goto done;
    /* the loop again, then the longest header -> latch path over its forward edges (blocks in address order) */
    memset(inloop, 0, (size_t)nb * sizeof *inloop);
    inloop[best_h] = 1;
    int sp = 0;
    if (!inloop[best_u]) inloop[best_u] = 1, stack[sp++] = best_u;
    while (sp) {
        int x = stack[--sp];
        for (int p = 0; p < nb; p++)
            for (int f = 0; f < b[p].n_succ; f++)
                if (b[p].succ[f] == x && !inloop[p]) inloop[p] = 1, stack[sp++] = p;
    }
    for (int k = 0; k < nb; k++) best[k] = -1;
    best[best_h] = b[best_h].last - b[best_h].first + 1;
    for (int k = best_h; k <= best_u; k++) {
        if (!inloop[k] || best[k] < 0) continue;
        for (int f = 0; f < b[k].n_succ; f++) {
            int s = b[k].succ[f];
            if (s <= k || !inloop[s]) continue;
            long w = best[k] + (b[s].last - b[s].first + 1);
            if (w > best[s]) best[s] = w;
        }
    }
    if (best[best_u] < 0) goto done;
    out->instructions = (int)best[best_u];
    out->header = in[b[best_h].first].addr;
    out->latch = in[b[best_u].last].addr;
    out->candidates = candidates;
    /* the kinds of instruction on that path, walked back from the latch */
    for (int k = best_u;;) {
        for (int i = b[k].first; i <= b[k].last; i++) {
            const char *op = in[i].op;
            if (!strncmp(op, "FFMA", 4) || !strncmp(op, "FMUL", 4) || !strncmp(op, "FADD", 4))
                out->fp32++;
            else if (!strncmp(op, "HFMA2", 5) || !strncmp(op, "HMUL2", 5) || !strncmp(op, "HADD2", 5))
                out->fp16x2++;
            else if (!strncmp(op, "HMMA", 4))
                out->mma++;
            else if (!strncmp(op, "LDS", 3))
                out->lds++;
            else if (!strncmp(op, "SHFL", 4))
                out->shfl++;
            else if (!strncmp(op, "MUFU", 4))
                out->mufu++;
            else if (!strcmp(op, "PMTRIG"))
                out->markers++;
        }
        if (k == best_h) break;
        int prev = -1;
        for (int p = best_h; p < k && prev < 0; p++)
            if (inloop[p] && best[p] >= 0)
                for (int f = 0; f < b[p].n_succ; f++)
                    if (b[p].succ[f] == k && best[p] + (b[k].last - b[k].first + 1) == best[k]) prev = p;
        if (prev < 0) break;
        k = prev;
    }
    out->instructions -= out->markers; /* the measurement's own markers */
    rc = 0;
done:
    kvq_free(leader);
    kvq_free(b);
    kvq_free(inloop);
    kvq_free(stack);
    kvq_free(best);
    kvq_free(in);
    return rc;
}
