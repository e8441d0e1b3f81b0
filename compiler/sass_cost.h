/* kvqc build's cost model (docs/cuda.md, "Cost model"): the executed warp-instructions of one kernel of a cubin,
 * from its SASS with line information (nvdisasm -gi -c of a cubin compiled with -lineinfo) and the warp counts of
 * its source locations in a real run under the emulator (tests/emu/profile.c). */
#ifndef KVQ_SASS_COST_H
#define KVQ_SASS_COST_H

#define SASS_LOC_DEPTH 16

/* A source location with its inlining: lines of the translation unit, innermost first, the last one in the
 * kernel's own body (nvdisasm's "line A inlined at line B" chain; the emulator's call stack). */
typedef struct {
    int line[SASS_LOC_DEPTH];
    int depth;
} sass_loc;

/* The emulator's counts: how many times a warp ran code of each location (summed over warps and blocks). */
typedef struct {
    const sass_loc *loc;
    const double *count;
    int n;
    /* lines that start a basic block of the emulated code (bb_line[l] != 0, l < n_lines), 2 when the line holds
     * no condition (if, ?:, &&, ||, a loop header): absent from the profile, such a line never ran, and its block
     * did not either; a line with a condition may share its block with code that ran (the GPU compiler computes
     * `if (c) x = y;` without a branch), so it says so only of a block none of whose lines ran. Another absent
     * line is inside a block the profile counts under its first line: it says nothing. 3: a line whose condition
     * is an if's or a ?:'s (not a loop's): its count is that of the blocks that start there, the condition's body,
     * which its comparisons and branch (they run with their block) may exceed. */
    const unsigned char *bb_line;
    int n_lines;
    /* lines of a loop under `#pragma unroll 1` (rolled[l] != 0, l < n_lines; may be NULL): the SASS loop whose
     * branch has that line runs once per source iteration */
    const unsigned char *rolled;
} sass_profile;

typedef struct {
    double executed;        /* warp-instructions issued: sum over basic blocks of count x instructions */
    int instructions;       /* static instructions of the function (no NOPs) */
    int blocks;             /* basic blocks */
    int blocks_run;         /* of which executed at least once */
    int instr_run;          /* their instructions: the code the step fetches, 16 bytes each (docs/cuda.md "Cost
                             * model": within 3 % of ncu's distinct instructions executed for the KIVI kernels of
                             * run 7, over by the duplicated alternatives that did not run for fp16) */
    int blocks_unknown;     /* reachable blocks with no location the profile knows (counted 0) */
    int instr_unknown;      /* their instructions */
} sass_cost;

/* The model's margin against the GPU: ncu counted up to 1.4 times the model's executed warp-instructions (H200,
 * docs/gpu-results.md run 6: the model read 0.93 of KIVI-2's, 0.86 of KIVI-4's, 0.84 of fp16's count at batch 1;
 * 0.84, 0.71 and 0.83 at batch 32; run 7 with the sibling calls' rule: 0.95, 0.87, 1.04 at batch 1, 0.92, 0.79,
 * 1.04 at batch 32), so kvqc's cost row under a per-byte bound by less than that reads "near", not "pass"
 * (docs/cuda.md, "Cost model"). */
#define SASS_COST_MARGIN 1.4

/* The count of every basic block of `fn` in `sass` (nvdisasm -gi -c text): the smallest profile count among the
 * locations of its unpredicated instructions (a block runs whenever its code's lines run: a line of an unrolled
 * loop runs once a copy, more often than the block), then bounded by the flow (a block runs at most as often as
 * its predecessors together, and as its successors together, to a fixed point), which separates copies of the
 * same lines (one template function specialised per tile kind) and zeroes code only a diverged warp reaches
 * (BRA.DIV's slow paths). Returns 0, 1 when the function is not in the text, -1 out of memory. */
int sass_cost_function(const char *sass, const char *fn, const sass_profile *prof, sass_cost *out);

#endif
