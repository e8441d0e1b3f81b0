/* Static issue count of a decode kernel from its SASS (docs/cuda.md, "Issue count"). */
#ifndef KVQ_SASS_COUNT_H
#define KVQ_SASS_COUNT_H

typedef struct {
    int instructions;        /* warp-instructions of one iteration of the token loop (longest path, no NOPs) */
    unsigned header, latch;  /* addresses of the loop's first instruction and of its back-edge branch */
    int candidates;          /* loops holding a token op (the smallest one is counted) */
    int fp32, fp16x2, mma, lds, shfl, mufu; /* of `instructions`: FFMA/FMUL/FADD, HFMA2/HMUL2/HADD2, HMMA, LDS*,
                                               SHFL*, MUFU* */
    int markers;             /* KVQ_MARK instructions on the path (not counted in `instructions`) */
} sass_loop_count;

/* Counts one iteration of the token loop of function `fn` in `sass` (the text of `cuobjdump -sass`). Returns 0,
 * 1 when the function or its token loop is not found, -1 when out of memory. */
int sass_count_token_loop(const char *sass, const char *fn, sass_loop_count *out);

/* The same for the innermost loop holding the marker KVQ_MARK(mark) (1..7; `pmevent mark`, PMTRIG 1 << mark in
 * SASS). A loop holding inner loops is counted with one pass through each. */
int sass_count_marked_loop(const char *sass, const char *fn, int mark, sass_loop_count *out);

#endif
