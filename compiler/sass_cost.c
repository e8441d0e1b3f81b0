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
    unsigned addr; /* offset in the function (the debug list's, for tools/cost-vs-ncu.py) */
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
        in.addr = (unsigned)strtoul(p + 2, NULL, 16);
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

/* Whether b is a's chain with one call site other than the innermost and the outermost replaced: the same line
 * reached through a sibling call (kvq_stage_tile's `kvq_stage(kb, ...)` against `kvq_stage(vb, ...)`). */
static int sibling_loc(const sass_loc *a, const sass_loc *b)
{
    if (a->depth != b->depth || a->depth < 3 || a->line[0] != b->line[0] ||
        a->line[a->depth - 1] != b->line[b->depth - 1])
        return 0;
    int diff = 0;
    for (int i = 1; i < a->depth - 1; i++) diff += a->line[i] != b->line[i];
    return diff == 1;
}

/* Whether opcode op (with its modifiers: LDS.128) is one of the n names of d */
static int op_in(const char *op, const char *const *d, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t l = strlen(d[i]);
        if (!strncmp(op, d[i], l) && (op[l] == '\0' || op[l] == '.')) return 1;
    }
    return 0;
}

/* Instructions that decide a branch: the comparisons and predicate logic that feed it, and the conditional branch
 * itself. On an if's line they run whenever their block does, while the profile counts that line only in the
 * emulated blocks that start there: the condition's body (`if (pg >= np) continue;` ran 2,128 times a step
 * and its `continue` 96), so the line's count does not bound their block. */
static int is_decision_op(const char *op)
{
    static const char *const d[] = {"ISETP", "FSETP", "DSETP", "HSETP2", "PLOP3", "R2P", "VOTE", "VOTEU", "UISETP",
                                    "UPLOP3", "BSSY", "BSYNC"};
    return op_in(op, d, sizeof d / sizeof d[0]) || !strcmp(op, "BRA") || !strncmp(op, "BRA.", 4);
}

/* Data instructions: one per source operation a copy of an unrolled body repeats (not the loop's own control) */
static int is_data_op(const char *op)
{
    static const char *const d[] = {"FFMA", "FMUL", "FADD", "FMNMX", "HFMA2", "HADD2", "HMUL2", "HMMA", "MUFU",
                                    "LDS",  "LDG",  "STS",  "STG",   "LDSM",  "F2F",   "FSEL", "FSETP"};
    return op_in(op, d, sizeof d / sizeof d[0]);
}

/* Integer and special-register instructions ptxas rematerializes: under register pressure it re-reads threadIdx
 * (S2R) and recomputes tid, lane and warp inside a hot loop, with the line info of the kernel's entry (KIVI-2's q.K
 * loop, 16,392 runs, held lines counted 1,696, once a warp: the least count of the block was theirs). Where their
 * line runs no more often than the entry block, they do not bound a block's count while another instruction of it
 * has a line (address arithmetic of a rarer line inside the loop still does: the fragments' reload a page). */
static int is_remat_op(const char *op)
{
    static const char *const d[] = {"S2R", "S2UR", "CS2R",   "MOV",  "IMAD",  "IADD3", "LEA",  "LOP3", "SHF",
                                    "SEL", "UMOV", "UIADD3", "ULEA", "ULOP3", "USHF",  "UIMAD", "USEL"};
    return op_in(op, d, sizeof d / sizeof d[0]);
}

static const fn_text *sort_f; /* qsort's context (the count runs on one thread) */
static int by_loc_op(const void *x, const void *y)
{
    const ins *a = &sort_f->in[*(const int *)x], *b = &sort_f->in[*(const int *)y];
    if (a->loc != b->loc) return a->loc < b->loc ? -1 : 1;
    return strcmp(a->op, b->op);
}

/* copies[i] for each instruction i of block k: how many copies of its line the block holds (the least count
 * among the line's data instruction kinds in the block; 1 for a line without data instructions). A line of a
 * loop body unrolled u times, or of an inner loop unrolled fully, runs once per copy: its count over its copies
 * is the block's. */
static void line_copies(const fn_text *f, const blk *bk, int *idx, int *copies)
{
    int n = 0;
    for (int i = bk->first; i <= bk->last; i++) {
        copies[i] = 1;
        if (f->in[i].loc >= 0 && is_data_op(f->in[i].op)) idx[n++] = i;
    }
    sort_f = f;
    qsort(idx, (size_t)n, sizeof *idx, by_loc_op);
    for (int i = 0; i < n;) {
        int least = 1 << 30, j = i;
        while (j < n && f->in[idx[j]].loc == f->in[idx[i]].loc) {
            int k = j;
            while (k < n && f->in[idx[k]].loc == f->in[idx[j]].loc && !strcmp(f->in[idx[k]].op, f->in[idx[j]].op))
                k++;
            if (k - j < least) least = k - j;
            j = k;
        }
        for (int m = bk->first; m <= bk->last; m++)
            if (f->in[m].loc == f->in[idx[i]].loc) copies[m] = least;
        i = j;
    }
}

/* Per block: whether its innermost natural loop is a `#pragma unroll 1` loop (its branch's line is one: its
 * lines are not copies), and whether that loop is a remainder copy of an unrolled loop (not rolled, every data
 * line of its own blocks held with more copies by a block outside it: the trips are counted in the unrolled
 * copy; off by less than u - 1 trips an entry). 0, -1 out of memory. */
static int loop_facts(const fn_text *f, const blk *b, int nb, const sass_profile *prof, const int *copies,
                      char *rolled, char *remainder)
{
    int rc = -1, n_loops = 0, cap = 0;
    for (int p = 0; p < nb; p++)
        for (int e = 0; e < b[p].n_succ; e++) cap += b[p].succ[e] <= p;
    if (cap == 0) return 0;
    char *in = kvq_calloc((size_t)cap * nb, 1);
    int *size = kvq_calloc((size_t)cap, sizeof *size), *stack = kvq_calloc((size_t)nb, sizeof *stack);
    int *inner = kvq_calloc((size_t)nb, sizeof *inner);
    if (!in || !size || !stack || !inner) goto out;
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
                for (int q = h; q < nb; q++)
                    for (int g = 0; g < b[q].n_succ; g++)
                        if (b[q].succ[g] == x && !L[q]) L[q] = 1, stack[sp++] = q, n++;
            }
            size[n_loops++] = n;
        }
    for (int k = 0; k < nb; k++) { /* the innermost loop of each block */
        inner[k] = -1;
        for (int l = 0; l < n_loops; l++)
            if (in[(size_t)l * nb + k] && (inner[k] < 0 || size[l] < size[inner[k]])) inner[k] = l;
    }
    for (int l = 0; l < n_loops; l++) {
        int is_rolled = 0, all_elsewhere = 1, data = 0, multi = 0;
        for (int k = 0; k < nb; k++) {
            if (inner[k] != l) continue;
            for (int i = b[k].first; i <= b[k].last; i++) {
                const int lc = f->in[i].loc, line = lc >= 0 ? f->locs[lc].line[0] : 0;
                is_rolled |= f->in[i].branch > 0 && prof->rolled && line > 0 && line < prof->n_lines &&
                             prof->rolled[line];
                if (lc < 0 || !is_data_op(f->in[i].op)) continue;
                data = 1;
                multi |= copies[i] > 1;
                int found = 0;
                for (int k2 = 0; k2 < nb && !found; k2++)
                    if (!in[(size_t)l * nb + k2])
                        for (int j = b[k2].first; j <= b[k2].last && !found; j++)
                            found = f->in[j].loc == lc && copies[j] > 1;
                all_elsewhere &= found;
            }
        }
        for (int k = 0; k < nb; k++)
            if (inner[k] == l) rolled[k] = (char)is_rolled, remainder[k] = !is_rolled && data && !multi && all_elsewhere;
    }
    rc = 0;
out:
    kvq_free(in);
    kvq_free(size);
    kvq_free(stack);
    kvq_free(inner);
    return rc;
}

/* The alternative copies of each instruction's location (for the first instruction of a location in a block,
 * alt_off[i] >= 0: alt_n[i] blocks at alt[alt_off[i]...]; later instructions of that location in the block point
 * to the same list; -1: none). Two blocks holding the same location are alternatives when neither reaches the
 * other without a loop's back edge (block order is a topological order of the forward edges): a line that calls
 * one function from each branch of a dispatch (KVQ_BY_KIND's branches all lie on the macro's line, so their
 * inlined copies have the same chains), or code the GPU compiler duplicated into two paths (loop unswitching,
 * tail duplication; the decode epilogue's two versions), runs each execution in one copy, and the profile's count
 * is their sum. Blocks on one path (a line split by a branch, a `for` line's condition and increment) each run
 * every execution: not alternatives. The widest set of such copies is found greedily in block order. Counting each
 * copy at the location's full count overcounted the fp16 decode kernel by 73 % against ncu (docs/cuda.md, "Cost
 * model"). 0, -1 out of memory. */
static int same_loc(const sass_loc *a, const sass_loc *b);

/* Whether the profile holds `want`'s line with a positive count under a chain that is `want`'s with some of its
 * call sites left out (the same first and last lines) and that no instruction of the function has; or under a
 * chain that `want` is the start of: ptxas left the outer call sites off (a convergence BSYNC labelled with the
 * bare line 3500 of the decode epilogue's `if (tx == 0)` store, whose "never ran" zeroed KIVI-2's whole epilogue
 * through the flow: 1.2 warp-instructions a token, ncu run 6). */
static int truncated_chain_ran(const sass_profile *prof, const fn_text *f, const sass_loc *want)
{
    for (int j = 0; j < prof->n; j++) {
        const sass_loc *h = &prof->loc[j];
        if (prof->count[j] > 0 && h->depth > want->depth &&
            !memcmp(h->line, want->line, sizeof want->line[0] * (size_t)want->depth))
            return 1;
        if (prof->count[j] <= 0 || h->depth >= want->depth || h->depth < 1 || h->line[0] != want->line[0] ||
            h->line[h->depth - 1] != want->line[want->depth - 1])
            continue;
        int k = 0;
        for (int i = 0; i < want->depth && k < h->depth; i++) k += want->line[i] == h->line[k];
        if (k != h->depth) continue;
        int in_sass = 0;
        for (int m = 0; m < f->n_locs && !in_sass; m++) in_sass = same_loc(&f->locs[m], h);
        if (!in_sass) return 1;
    }
    return 0;
}

/* The data instructions of location L in block k, per copy of the line (copies[]): "LDS:2 FADD:4 " in order of
 * first appearance (copies of one body appear in the same order). Empty: none. */
static void data_sig(const fn_text *f, const blk *bk, int L, const int *copies, char *sig, size_t n)
{
    size_t len = 0;
    sig[0] = '\0';
    for (int i = bk->first; i <= bk->last; i++) {
        if (f->in[i].loc != L || !is_data_op(f->in[i].op)) continue;
        int seen = 0;
        for (int j = bk->first; j < i && !seen; j++) seen = f->in[j].loc == L && !strcmp(f->in[j].op, f->in[i].op);
        if (seen) continue;
        int cnt = 0;
        for (int j = i; j <= bk->last; j++) cnt += f->in[j].loc == L && !strcmp(f->in[j].op, f->in[i].op);
        const int c = copies[i] > 0 ? copies[i] : 1;
        int w = snprintf(sig + len, n - len, "%s:%d/%d ", f->in[i].op, cnt / c, cnt % c);
        if (w < 0 || (size_t)w >= n - len) return; /* long: compared as far as it goes */
        len += (size_t)w;
    }
}

typedef struct {
    int *off, *n; /* per instruction */
    int *blk;     /* the lists */
    int len, cap;
} alt_list;

static int alt_copies(const fn_text *f, const blk *b, int nb, const char *reach, const char *remainder, const int *copies,
                      alt_list *al)
{
    const int words = (nb + 63) / 64;
    int rc = -1;
    unsigned long long *R = kvq_calloc((size_t)nb * words, sizeof *R);
    int *who = kvq_calloc((size_t)nb, sizeof *who), *blk_of = kvq_calloc((size_t)f->n, sizeof *blk_of);
    al->off = kvq_calloc((size_t)f->n, sizeof *al->off), al->n = kvq_calloc((size_t)f->n, sizeof *al->n);
    if (!R || !who || !blk_of || !al->off || !al->n) goto out;
#define REACHES(a, c) ((R[(size_t)(a) * words + (c) / 64] >> ((c) % 64)) & 1ull)
    for (int k = nb - 1; k >= 0; k--)
        for (int e = 0; e < b[k].n_succ; e++) {
            const int s = b[k].succ[e];
            if (s <= k) continue; /* a back edge */
            R[(size_t)k * words + s / 64] |= 1ull << (s % 64);
            for (int w = 0; w < words; w++) R[(size_t)k * words + w] |= R[(size_t)s * words + w];
        }
    for (int k = 0; k < nb; k++)
        for (int i = b[k].first; i <= b[k].last; i++) blk_of[i] = k, al->off[i] = -1;
    for (int k = 0; k < nb; k++) {
        if (!reach[k] || remainder[k]) continue;
        for (int i = b[k].first; i <= b[k].last; i++) {
            const int L = f->in[i].loc;
            if (L < 0 || (f->in[i].pred && !f->in[i].branch)) continue;
            int first = b[k].first;
            while (first < i && f->in[first].loc != L) first++;
            if (first < i) { /* the location's list in this block is made */
                al->off[i] = al->off[first], al->n[i] = al->n[first];
                continue;
            }
            /* the other blocks holding L (counted the same way), in block order */
            int n_who = 0;
            for (int j = 0; j < f->n; j++) {
                const int kj = blk_of[j];
                if (kj == k || f->in[j].loc != L || !reach[kj] || remainder[kj] || (f->in[j].pred && !f->in[j].branch))
                    continue;
                if (n_who && who[n_who - 1] == kj) continue;
                who[n_who++] = kj;
            }
            int n_picked = 0;
            if (grow((void **)&al->blk, &al->cap, al->len + n_who + 1, sizeof *al->blk)) goto out;
            int *picked = al->blk + al->len;
            /* copies of the same body: the same data instructions per copy of the line, on one path or not (a
             * loop unrolled across blocks: the decode epilogue's per-head code, split by each head's stores) */
            char mine[256], theirs[256];
            data_sig(f, &b[k], L, copies, mine, sizeof mine);
            for (int a = 0; a < n_who && mine[0]; a++) {
                data_sig(f, &b[who[a]], L, copies, theirs, sizeof theirs);
                if (!strcmp(mine, theirs)) picked[n_picked++] = who[a], who[a] = -1;
            }
            /* alternatives: neither reaches the other, nor any copy picked */
            const int n_same = n_picked;
            for (int a = 0; a < n_who; a++) {
                const int c = who[a];
                if (c < 0) continue;
                int unrelated = !REACHES(k, c) && !REACHES(c, k);
                for (int p = n_same; p < n_picked && unrelated; p++)
                    unrelated = !REACHES(picked[p], c) && !REACHES(c, picked[p]);
                if (unrelated) picked[n_picked++] = c;
            }
            if (n_picked) al->off[i] = al->len, al->n[i] = n_picked, al->len += n_picked;
        }
    }
#undef REACHES
    rc = 0;
out:
    kvq_free(R), kvq_free(who), kvq_free(blk_of);
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
    /* Merged call sites: code that two sibling calls share (the same function inlined twice with arguments that
     * differ only in value, one copy in the SASS) carries one call's chain, and the other call's runs are in the
     * profile under a chain no instruction has. A location the profile never ran under its own chain takes the
     * counts of such chains one call site away (sibling_loc): KIVI-2's value parameters, staged by the value warps
     * through the second `kvq_stage` call of kvq_stage_tile, are SASS of the first (ncu run 7: 1,243 instructions
     * of KIVI-2 the model had counted 0). Of several such chains the largest count, not their sum: ptxas also
     * labels separate copies with the chain of a third call (fp16's key and value row copies, each labelled with
     * the generic path's `kvq_stage(vb, ...)`), each copy running one of them. Not a location that ran under its
     * own chain: that chain is then this code's. */
    {
        char *in_sass = kvq_calloc((size_t)prof->n + 1, 1);
        if (!in_sass) goto done;
        for (int j = 0; j < prof->n; j++)
            for (int m = 0; m < f.n_locs && !in_sass[j]; m++) in_sass[j] = same_loc(&f.locs[m], &prof->loc[j]);
        for (int i = 0; i < f.n_locs; i++) {
            if (loc_count[i] > 0) continue;
            double sib = 0.0;
            for (int j = 0; j < prof->n; j++)
                if (!in_sass[j] && prof->count[j] > sib && sibling_loc(&f.locs[i], &prof->loc[j])) sib = prof->count[j];
            if (sib > 0) loc_count[i] = sib;
        }
        kvq_free(in_sass);
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
    /* first estimate: the least count among the lines of the block's unpredicated instructions and branches,
     * each over its copies in the block (not in a `#pragma unroll 1` loop's blocks: their lines are not copies) */
    const double unknown = 1e300;
    double *first_est = kvq_calloc((size_t)nb, sizeof *first_est);
    int *copies = kvq_calloc((size_t)f.n, sizeof *copies), *idx = kvq_calloc((size_t)f.n, sizeof *idx);
    char *rolled = kvq_calloc((size_t)nb, 1), *remainder = kvq_calloc((size_t)nb, 1);
    int facts = -1;
    alt_list al;
    memset(&al, 0, sizeof al);
    double *prev = kvq_calloc((size_t)nb, sizeof *prev);
    if (first_est && copies && idx && rolled && remainder && prev) {
        for (int k = 0; k < nb; k++) line_copies(&f, &b[k], idx, copies);
        facts = loop_facts(&f, b, nb, prof, copies, rolled, remainder);
        if (facts == 0) facts = alt_copies(&f, b, nb, reach, remainder, copies, &al);
    }
    if (facts != 0) {
        kvq_free(first_est), kvq_free(copies), kvq_free(idx), kvq_free(rolled), kvq_free(remainder);
        kvq_free(al.off), kvq_free(al.n), kvq_free(al.blk), kvq_free(prev);
        goto done;
    }
    /* Rounds: a location's count is shared among its alternative copies in proportion to their counts of the
     * round before (equal parts in the first round: the lines cannot say which copy ran; exact in total when the
     * copies are the same length), so that a copy the flow finds dead (a line of its own never ran) leaves the
     * whole count to the others; until the counts hold still. */
    /* the entry block's count (every warp runs it once): what a value computed at the kernel's entry runs */
    double entry_c = unknown;
    for (int i = b[0].first; nb > 0 && i <= b[0].last; i++)
        if (f.in[i].loc >= 0 && loc_count[f.in[i].loc] > 0.0 && loc_count[f.in[i].loc] < entry_c)
            entry_c = loc_count[f.in[i].loc];
    const char *b_rolled = rolled;
    for (int round = 0; round < 16; round++) {
        for (int k = 0; k < nb; k++) {
            double c = unknown, c_remat = unknown; /* the least count over the other instructions, and over these */
            int seen = 0, never = 0;
            for (int i = b[k].first; i <= b[k].last; i++) {
                if (f.in[i].loc < 0) continue;
                double lc = loc_count[f.in[i].loc];
                if (f.in[i].pred && !f.in[i].branch) continue; /* its line may run less often than the block */
                {
                    const int l = f.locs[f.in[i].loc].line[0];
                    if (lc >= 0 && prof->bb_line && l > 0 && l < prof->n_lines && prof->bb_line[l] == 3 &&
                        is_decision_op(f.in[i].op))
                        continue; /* a condition's decision: its line counts the body (is_decision_op) */
                }
                /* a line the profile does not hold: the emulator counts a basic block under its first line, and
                 * code it never ran has no count either. A block none of whose lines ran, one of them the first
                 * line of an emulated basic block, never ran; otherwise such lines say nothing (the GPU compiler
                 * may compute a condition's branch without branching: its line then shares a block with others) */
                if (lc < 0) {
                    const int l = f.locs[f.in[i].loc].line[0];
                    if (!(prof->bb_line && l > 0 && l < prof->n_lines && prof->bb_line[l])) continue;
                    /* the profile holds the line under this chain with call sites left out, a chain no SASS
                     * instruction has: the emulator's context for it is wrong, and it ran here (a function's last
                     * statement after a call into the emulator's headers is profiled without the function's own
                     * call site: kvq_mma_vinv's `return`, whose "never ran" zeroed KIVI-2's whole epilogue
                     * through the flow, -25 % against ncu). A shorter chain the SASS has is another real path
                     * (a helper called directly by another copy): it says nothing of this one */
                    if (truncated_chain_ran(prof, &f, &f.locs[f.in[i].loc])) continue;
                    if (prof->bb_line[l] != 2) { /* a line with a condition that never ran */
                        never = 1;
                        continue;
                    }
                    lc = 0.0; /* 2: a line that starts a block and has no condition of its own: it never ran */
                }
                seen = 1;
                const int cp = rolled[k] ? 1 : copies[i];
                if (al.off[i] < 0) lc /= cp;
                else { /* this block's part: the line's executions are the sum over its copies of count x copies */
                    double mine = round ? prev[k] : 1.0, all = mine * cp, all1 = cp;
                    int equal = mine >= unknown;
                    for (int a = 0; a < al.n[i]; a++) {
                        const int j = al.blk[al.off[i] + a];
                        int cj = 1;
                        for (int m = b[j].first; m <= b[j].last; m++)
                            if (f.in[m].loc == f.in[i].loc) {
                                cj = b_rolled[j] ? 1 : copies[m];
                                break;
                            }
                        const double w = round ? prev[j] : 1.0;
                        equal |= w >= unknown;
                        all += w * cj, all1 += cj;
                    }
                    lc *= equal || all <= 0.0 ? 1.0 / all1 : mine / all;
                }
                /* an entry value recomputed here (a line that never ran still says the block did not) */
                if (is_remat_op(f.in[i].op) && lc > 0.0 && lc <= entry_c) {
                    if (lc < c_remat) c_remat = lc;
                } else if (lc < c)
                    c = lc;
            }
            if (c >= unknown) c = c_remat; /* a block of such instructions only: theirs is all there is */
            b[k].count = !reach[k] || remainder[k] ? 0.0 : seen ? c : never ? 0.0 : unknown;
            if (round == 0) first_est[k] = b[k].count;
        }
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
        int still = round > 0;
        for (int k = 0; k < nb; k++) {
            const double d = b[k].count - prev[k];
            still &= d < 1e-9 * (1.0 + prev[k]) && d > -1e-9 * (1.0 + prev[k]);
            prev[k] = b[k].count;
        }
        if (still || al.len == 0) break;
    }
    kvq_free(copies), kvq_free(idx), kvq_free(rolled), kvq_free(remainder);
    kvq_free(al.off), kvq_free(al.n), kvq_free(al.blk), kvq_free(prev);
    const char *dbg = getenv("KVQ_COST_DEBUG");
    for (int k = 0; k < nb; k++) {
        int n = b[k].last - b[k].first + 1;
        if (dbg && !strcmp(dbg, fn)) {
            fprintf(stderr, "block %d ins %d..%d n %d reach %d count %.0f est %.0f addr %x..%x", k, b[k].first, b[k].last,
                    n, reach[k], b[k].count, first_est[k], f.in[b[k].first].addr, f.in[b[k].last].addr);
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
        if (b[k].count > 0) out->instr_run += n;
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
