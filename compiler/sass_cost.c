/* kvqc build's cost model (docs/cuda.md, "Cost model"): SASS with line information -> basic blocks -> each
 * block's executions from the emulator's warp counts of its source locations -> executed warp-instructions. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "alloc.h"
#include "sass_cost.h"

typedef struct {
    int pred;      /* guarded by a predicate other than PT */
    int branch;    /* BRA to a label (not BRA.DIV: the warp runs converged, the fall-through is taken) */
    int stop;      /* EXIT, RET or an unconditional BRA: no fall-through unless predicated */
    int target;    /* label id of a branch */
    int loc;       /* index into the function's locations, -1 none */
    char op[32];   /* opcode with modifiers (LDS.128) */
} ins;

typedef struct {
    int first, last;
    int succ[2], n_succ;
    double count;
} blk;

typedef struct {
    ins *in;
    int n, cap;
    sass_loc *locs;
    int n_locs, cap_locs;
    char (*label)[32];
    int *label_at; /* instruction index of each label */
    int n_labels, cap_labels;
} fn_text;

static int grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap) return 0;
    int nc = *cap ? *cap : 256;
    while (nc < need) nc *= 2;
    void *q = kvq_realloc(*p, (size_t)nc * elem);
    if (!q) return -1;
    *p = q, *cap = nc;
    return 0;
}

static int label_id(fn_text *f, const char *name, size_t len)
{
    if (len >= sizeof f->label[0]) len = sizeof f->label[0] - 1;
    for (int i = 0; i < f->n_labels; i++)
        if (strlen(f->label[i]) == len && !strncmp(f->label[i], name, len)) return i;
    int cap = f->cap_labels;
    if (grow((void **)&f->label, &cap, f->n_labels + 1, sizeof f->label[0])) return -1;
    cap = f->cap_labels;
    if (grow((void **)&f->label_at, &cap, f->n_labels + 1, sizeof f->label_at[0])) return -1;
    f->cap_labels = cap;
    memcpy(f->label[f->n_labels], name, len);
    f->label[f->n_labels][len] = '\0';
    f->label_at[f->n_labels] = -1;
    return f->n_labels++;
}

/* "\t//## File "x", line 12 inlined at "x", line 40": the first line number */
static int comment_line(const char *s)
{
    const char *t = strstr(s, ", line ");
    return t ? atoi(t + 7) : -1;
}

/* The text of function `fn`: instructions with their locations and the labels. 0 ok, 1 absent, -1 no memory. */
static int parse(const char *sass, const char *fn, fn_text *f)
{
    char head[160];
    snprintf(head, sizeof head, "\n.text.%s:\n", fn);
    const char *s = strstr(sass, head);
    if (!s) return 1;
    s += strlen(head);
    sass_loc cur = {{0}, 0};
    int cur_id = -1, in_group = 0;
    while (*s) {
        const char *e = strchr(s, '\n');
        size_t len = e ? (size_t)(e - s) : strlen(s);
        char line[512];
        if (len >= sizeof line) len = sizeof line - 1;
        memcpy(line, s, len);
        line[len] = '\0';
        s = e ? e + 1 : s + len;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (!strncmp(p, ".section", 8) || !strncmp(p, "//----", 6)) break;
        if (!strncmp(p, "//##", 4)) {
            if (!in_group) cur.depth = 0, in_group = 1, cur_id = -1;
            int l = comment_line(p);
            if (l > 0 && cur.depth < SASS_LOC_DEPTH) cur.line[cur.depth++] = l;
            continue;
        }
        in_group = 0;
        if (p[0] == '.' && p[len - (size_t)(p - line) - 1] == ':') { /* a label */
            int id = label_id(f, p, strlen(p) - 1);
            if (id < 0) return -1;
            f->label_at[id] = f->n;
            continue;
        }
        if (strncmp(p, "/*", 2)) continue;
        const char *q = strstr(p, "*/");
        if (!q) continue;
        q += 2;
        while (*q == ' ') q++;
        if (!*q) continue;
        ins in;
        memset(&in, 0, sizeof in);
        in.target = -1;
        if (*q == '@') {
            in.pred = strncmp(q, "@PT ", 4) != 0;
            while (*q && *q != ' ') q++;
            while (*q == ' ') q++;
        }
        size_t n = strcspn(q, " ;");
        char op[32];
        if (n == 0 || n >= sizeof op) continue;
        memcpy(op, q, n);
        op[n] = '\0';
        if (!strcmp(op, "NOP")) continue;
        snprintf(in.op, sizeof in.op, "%s", op);
        if (!strcmp(op, "BRA") || (!strncmp(op, "BRA.", 4) && strcmp(op, "BRA.DIV"))) {
            const char *t = strstr(q, "`(");
            if (t) {
                t += 2;
                int id = label_id(f, t, strcspn(t, ")"));
                if (id < 0) return -1;
                in.branch = 1, in.target = id;
                in.stop = !in.pred;
            }
        }
        if (!strcmp(op, "EXIT") || !strncmp(op, "RET", 3)) in.stop = !in.pred, in.branch = -1;
        if (cur.depth > 0 && cur_id < 0) { /* one id per distinct chain */
            for (int i = 0; i < f->n_locs && cur_id < 0; i++)
                if (f->locs[i].depth == cur.depth && !memcmp(f->locs[i].line, cur.line, sizeof cur.line[0] * cur.depth))
                    cur_id = i;
            if (cur_id < 0) {
                if (grow((void **)&f->locs, &f->cap_locs, f->n_locs + 1, sizeof *f->locs)) return -1;
                f->locs[f->n_locs] = cur;
                cur_id = f->n_locs++;
            }
        }
        in.loc = cur_id;
        if (grow((void **)&f->in, &f->cap, f->n + 1, sizeof *f->in)) return -1;
        f->in[f->n++] = in;
    }
    return 0;
}

static int same_loc(const sass_loc *a, const sass_loc *b)
{
    if (a->depth != b->depth) return 0;
    for (int i = 0; i < a->depth; i++)
        if (a->line[i] != b->line[i]) return 0;
    return 1;
}

/* Data instructions: one per source operation a copy of an unrolled body repeats (not the loop's own control) */
static int is_data_op(const char *op)
{
    static const char *const d[] = {"FFMA", "FMUL", "FADD", "FMNMX", "HFMA2", "HADD2", "HMUL2", "HMMA", "MUFU",
                                    "LDS",  "LDG",  "STS",  "STG",   "LDSM",  "F2F",   "FSEL", "FSETP"};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++) {
        size_t n = strlen(d[i]);
        if (!strncmp(op, d[i], n) && (op[n] == '\0' || op[n] == '.')) return 1;
    }
    return 0;
}

static const fn_text *sort_f; /* qsort's context (the count runs on one thread) */
static int by_loc_op(const void *x, const void *y)
{
    const ins *a = &sort_f->in[*(const int *)x], *b = &sort_f->in[*(const int *)y];
    if (a->loc != b->loc) return a->loc < b->loc ? -1 : 1;
    return strcmp(a->op, b->op);
}

/* Loops the GPU compiler unrolled: the profile counts a line once per source iteration, the SASS loop runs once
 * per u of them. For each natural loop (innermost first) whose source loop is not `#pragma unroll 1`: u = the
 * copies of its most repeated line (the least count among that line's data instructions' kinds), and its own
 * blocks' estimates are divided by u. A loop whose lines all belong to such an unrolled loop is its remainder
 * copy: its estimates become 0 (all trips counted in the unrolled copy; off by less than u - 1 trips an entry).
 * 0, -1 out of memory. */
static int unroll_loops(const fn_text *f, blk *b, int nb, const sass_profile *prof, const double *loc_count)
{
    (void)loc_count;
    int rc = -1, n_loops = 0;
    char *in = NULL, *own = NULL;
    int *head = NULL, *size = NULL, *unroll = NULL, *stack = NULL, *order = NULL, *stack2 = NULL;
    /* back edges p -> h (h at or before p): one natural loop each */
    int cap = 0;
    for (int p = 0; p < nb; p++)
        for (int e = 0; e < b[p].n_succ; e++) cap += b[p].succ[e] <= p;
    if (cap == 0) return 0;
    in = kvq_calloc((size_t)cap * nb, 1);
    own = kvq_calloc((size_t)cap * nb, 1);
    head = kvq_calloc((size_t)cap, sizeof *head);
    size = kvq_calloc((size_t)cap, sizeof *size);
    unroll = kvq_calloc((size_t)cap, sizeof *unroll);
    order = kvq_calloc((size_t)cap, sizeof *order);
    stack = kvq_calloc((size_t)nb, sizeof *stack);
    stack2 = kvq_calloc((size_t)f->n, sizeof *stack2);
    if (!in || !own || !head || !size || !unroll || !stack || !order || !stack2) goto out;
    for (int p = 0; p < nb; p++)
        for (int e = 0; e < b[p].n_succ; e++) {
            int h = b[p].succ[e];
            if (h > p) continue;
            char *L = in + (size_t)n_loops * nb;
            int sp = 0, n = 1;
            L[h] = 1;
            if (!L[p]) L[p] = 1, stack[sp++] = p, n++;
            while (sp) {
                int x = stack[--sp];
                for (int q = 0; q < nb; q++)
                    for (int g = 0; g < b[q].n_succ; g++)
                        if (b[q].succ[g] == x && !L[q] && q >= h) L[q] = 1, stack[sp++] = q, n++;
            }
            head[n_loops] = h, size[n_loops] = n, order[n_loops] = n_loops;
            n_loops++;
        }
    for (int i = 0; i < n_loops; i++) /* innermost (smallest) first */
        for (int j = i + 1; j < n_loops; j++)
            if (size[order[j]] < size[order[i]]) {
                int t = order[i];
                order[i] = order[j], order[j] = t;
            }
    /* a loop's own blocks: not in a smaller loop */
    for (int oi = 0; oi < n_loops; oi++) {
        int l = order[oi];
        for (int k = 0; k < nb; k++) {
            if (!in[(size_t)l * nb + k]) continue;
            int inner = 0;
            for (int oj = 0; oj < oi && !inner; oj++) inner = in[(size_t)order[oj] * nb + k] && size[order[oj]] < size[l];
            own[(size_t)l * nb + k] = !inner;
        }
    }
    for (int l = 0; l < n_loops; l++) {
        unroll[l] = 1;
        int rolled = 0; /* `#pragma unroll 1` over one of its lines' loops */
        for (int k = 0; k < nb && !rolled; k++)
            if (own[(size_t)l * nb + k])
                for (int i = b[k].first; i <= b[k].last && !rolled; i++) {
                    int lc = f->in[i].loc;
                    int line = lc >= 0 ? f->locs[lc].line[0] : 0;
                    rolled = prof->rolled && line > 0 && line < prof->n_lines && prof->rolled[line] &&
                             f->in[i].branch > 0;
                }
        if (rolled) continue;
        /* copies of each line: the least count over its data instruction kinds */
        int n = 0;
        for (int k = 0; k < nb; k++)
            if (own[(size_t)l * nb + k])
                for (int i = b[k].first; i <= b[k].last; i++)
                    if (f->in[i].loc >= 0 && is_data_op(f->in[i].op)) stack2[n++] = i;
        sort_f = f;
        qsort(stack2, (size_t)n, sizeof *stack2, by_loc_op);
        for (int i = 0; i < n;) {
            int least = 1 << 30, j = i;
            while (j < n && f->in[stack2[j]].loc == f->in[stack2[i]].loc) {
                int k = j;
                while (k < n && f->in[stack2[k]].loc == f->in[stack2[j]].loc &&
                       !strcmp(f->in[stack2[k]].op, f->in[stack2[j]].op))
                    k++;
                if (k - j < least) least = k - j;
                j = k;
            }
            if (least < (1 << 30) && least > unroll[l]) unroll[l] = least;
            i = j;
        }
    }
    for (int l = 0; l < n_loops; l++) {
        int rem = 0;
        if (unroll[l] == 1) /* a remainder: every line of its own blocks is in a loop unrolled more */
            for (int m = 0; m < n_loops && !rem; m++) {
                if (unroll[m] <= 1 || m == l) continue;
                int all = 1, any = 0;
                for (int k = 0; k < nb && all; k++)
                    if (own[(size_t)l * nb + k])
                        for (int i = b[k].first; i <= b[k].last && all; i++) {
                            if (f->in[i].loc < 0 || f->in[i].branch) continue;
                            int found = 0;
                            for (int k2 = 0; k2 < nb && !found; k2++)
                                if (own[(size_t)m * nb + k2])
                                    for (int j = b[k2].first; j <= b[k2].last && !found; j++)
                                        found = f->in[j].loc == f->in[i].loc;
                            all = found, any = 1;
                        }
                rem = all && any;
            }
        for (int k = 0; k < nb; k++)
            if (own[(size_t)l * nb + k] && b[k].count < 1e299) b[k].count = rem ? 0.0 : b[k].count / unroll[l];
    }
    rc = 0;
out:
    kvq_free(in);
    kvq_free(own);
    kvq_free(head);
    kvq_free(size);
    kvq_free(unroll);
    kvq_free(stack);
    kvq_free(order);
    kvq_free(stack2);
    return rc;
}

int sass_cost_function(const char *sass, const char *fn, const sass_profile *prof, sass_cost *out)
{
    memset(out, 0, sizeof *out);
    fn_text f;
    memset(&f, 0, sizeof f);
    int rc = parse(sass, fn, &f);
    blk *b = NULL;
    char *leader = NULL, *reach = NULL;
    double *loc_count = NULL;
    int *stack = NULL;
    if (rc != 0 || f.n == 0) {
        rc = rc ? rc : 1;
        goto done;
    }
    rc = -1;
    leader = kvq_calloc((size_t)f.n + 1, 1);
    b = kvq_calloc((size_t)f.n, sizeof *b);
    loc_count = kvq_calloc((size_t)f.n_locs + 1, sizeof *loc_count);
    reach = kvq_calloc((size_t)f.n, 1);
    stack = kvq_calloc((size_t)f.n, sizeof *stack);
    if (!leader || !b || !loc_count || !reach || !stack) goto done;
    /* each location's count; -1 when the profile does not hold it (never run, as far as the profile knows) */
    for (int i = 0; i < f.n_locs; i++) {
        loc_count[i] = -1.0;
        for (int j = 0; j < prof->n; j++)
            if (same_loc(&f.locs[i], &prof->loc[j])) {
                loc_count[i] = prof->count[j];
                break;
            }
    }
    /* basic blocks: the entry, labels, and what follows a branch or an exit */
    leader[0] = 1;
    for (int i = 0; i < f.n_labels; i++)
        if (f.label_at[i] >= 0 && f.label_at[i] < f.n) leader[f.label_at[i]] = 1;
    for (int i = 0; i < f.n; i++)
        if (f.in[i].branch) leader[i + 1] = 1;
    int nb = 0;
    int *blk_of = stack; /* reused below as the reachability stack after this */
    for (int i = 0; i < f.n; i++) {
        if (leader[i]) b[nb++].first = i;
        b[nb - 1].last = i;
        blk_of[i] = nb - 1;
    }
    for (int k = 0; k < nb; k++) {
        const ins *t = &f.in[b[k].last];
        if (t->branch > 0 && t->target >= 0 && f.label_at[t->target] >= 0 && f.label_at[t->target] < f.n)
            b[k].succ[b[k].n_succ++] = blk_of[f.label_at[t->target]];
        if (!t->stop && k + 1 < nb) b[k].succ[b[k].n_succ++] = k + 1;
    }
    /* reachable from the entry (a BRA.DIV slow path is not) */
    int sp = 0;
    reach[0] = 1;
    stack[sp++] = 0;
    while (sp) {
        int x = stack[--sp];
        for (int e = 0; e < b[x].n_succ; e++)
            if (!reach[b[x].succ[e]]) reach[b[x].succ[e]] = 1, stack[sp++] = b[x].succ[e];
    }
    /* first estimate: the least count among the locations of the block's unpredicated instructions */
    const double unknown = 1e300;
    double *first_est = kvq_calloc((size_t)nb, sizeof *first_est);
    if (!first_est) goto done;
    for (int k = 0; k < nb; k++) {
        double c = unknown;
        int seen = 0, never = 0;
        for (int i = b[k].first; i <= b[k].last; i++) {
            if (f.in[i].loc < 0) continue;
            double lc = loc_count[f.in[i].loc];
            if (f.in[i].pred && !f.in[i].branch) continue; /* its line may run less often than the block */
            /* a line the profile does not hold: the emulator counts a basic block under its first line, and
             * code it never ran has no count either. A block none of whose lines ran, one of them the first
             * line of an emulated basic block, never ran; otherwise such lines say nothing (the GPU compiler
             * may compute a condition's branch without branching: its line then shares a block with others) */
            if (lc < 0) {
                const int l = f.locs[f.in[i].loc].line[0];
                never |= prof->bb_line && l > 0 && l < prof->n_lines && prof->bb_line[l];
                continue;
            }
            seen = 1;
            if (lc < c) c = lc;
        }
        b[k].count = !reach[k] ? 0.0 : seen ? c : never ? 0.0 : unknown;
        first_est[k] = b[k].count;
    }
    if (unroll_loops(&f, b, nb, prof, loc_count) != 0) goto done;
    /* the flow: a block runs at most as often as its predecessors together and its successors together */
    for (int it = 0, changed = 1; changed && it < 4 * nb; it++) {
        changed = 0;
        for (int k = 0; k < nb; k++) {
            if (!reach[k]) continue;
            if (k > 0) {
                double in = 0.0;
                for (int p = 0; p < nb; p++)
                    for (int e = 0; e < b[p].n_succ; e++)
                        if (b[p].succ[e] == k) in += b[p].count;
                if (in < b[k].count) b[k].count = in, changed = 1;
            }
            if (b[k].n_succ) {
                double o = 0.0;
                for (int e = 0; e < b[k].n_succ; e++) o += b[b[k].succ[e]].count;
                if (o < b[k].count) b[k].count = o, changed = 1;
            }
        }
    }
    const char *dbg = getenv("KVQ_COST_DEBUG");
    for (int k = 0; k < nb; k++) {
        int n = b[k].last - b[k].first + 1;
        if (dbg && !strcmp(dbg, fn)) {
            fprintf(stderr, "block %d ins %d..%d n %d reach %d count %.0f est %.0f", k, b[k].first, b[k].last, n,
                    reach[k], b[k].count, first_est[k]);
            for (int i = b[k].first; i <= b[k].last; i++)
                if (f.in[i].loc >= 0 && (i == b[k].first || f.in[i].loc != f.in[i - 1].loc))
                    fprintf(stderr, " [%d:%.0f%s]", f.locs[f.in[i].loc].line[0], loc_count[f.in[i].loc],
                            f.in[i].pred ? "p" : "");
            fprintf(stderr, "\n");
        }
        out->instructions += n;
        if (b[k].count >= unknown) {
            out->blocks_unknown++;
            out->instr_unknown += n;
            continue;
        }
        out->executed += b[k].count * n;
        out->blocks_run += b[k].count > 0;
    }
    out->blocks = nb;
    kvq_free(first_est);
    rc = 0;
done:
    kvq_free(f.in);
    kvq_free(f.locs);
    kvq_free(f.label);
    kvq_free(f.label_at);
    kvq_free(leader);
    kvq_free(b);
    kvq_free(loc_count);
    kvq_free(reach);
    kvq_free(stack);
    return rc;
}
