/* Parameter structs of the emulator's test kernels: one POD struct per entry point, shared by the kernel sources
 * (CUDA C, compiled by NVRTC and by the host compiler) and the C test programs that launch them. */
#ifndef EMU_KERNEL_PARAMS_H
#define EMU_KERNEL_PARAMS_H

/* reduce.cu */
struct block_sum_params {
    const float *in;
    float *out; /* one sum per block */
    int n;
};
struct sync_vote_params {
    const int *pred; /* one per thread of one block */
    int *out;        /* [count, and, or] as every thread saw them: 3 per thread */
};
struct index_params {
    unsigned *out; /* 8 words per thread: threadIdx xyz, blockIdx xyz, linear id, a checksum of the dims */
};
struct histogram_params {
    const unsigned *in;
    unsigned *hist; /* 64 bins, global */
    unsigned *stats; /* [0]: atomicMax of all values, [1]: atomicMin, [2]: atomicInc counter, [3]: atomicCAS winners */
    float *fsum;
    int n;
};

struct handoff_params {
    int *out; /* one per thread */
};

/* warp.cu */
struct warp_params {
    const unsigned *in; /* one per thread */
    unsigned *out;      /* WARP_OUTS per thread */
    int width;          /* segment width for the width-limited shuffles */
};
#define WARP_OUTS 21

/* matmul.cu: C[M][N] = A[M][K] * B[K][N], row-major floats */
struct matmul_params {
    const float *a, *b;
    float *c;
    int m, n, k;
    int bug; /* deliberate bugs the emulator must expose: 1 leaves out the cp.async wait, 2 the barrier that
                keeps a buffer from being refilled while other threads still read it, 3 waits with wait_group 1
                while the tile it needs is the newest group */
};
#define MM_TILE 16

/* half.cu */
struct half_sweep_params {
    const unsigned short *bits; /* every 16-bit pattern */
    float *h2f, *bf2f;          /* kvq_h2f / kvq_bf2f of each */
    const float *f;             /* floats to round */
    unsigned short *f2h, *f2bf; /* kvq_f2h / kvq_f2bf of each */
    int n_bits, n_f;
};
struct half_arith_params {
    const unsigned *a, *b, *c;                          /* packed pairs (.x in the low 16 bits) */
    unsigned *hfma, *hmul, *hadd, *bffma;               /* per pair */
    const float *lo, *hi;                               /* float pairs to pack */
    unsigned *f2h2, *f2bf2;                             /* kvq_f2h2 / kvq_f2bf2 of (lo, hi) */
    float *h22f2, *bf22f2;                              /* kvq_h22f2 / kvq_bf22f2 of a: 2 floats per pair */
    int n;
};

/* intrin.cu */
struct intrin_params {
    const unsigned *u; /* 4 words per thread */
    const float *f;    /* 2 floats per thread */
    const unsigned *vin; /* uint4 source, 4 words per thread */
    unsigned *out;     /* INTRIN_OUTS per thread */
    float *fout;       /* INTRIN_FOUTS per thread */
};
#define INTRIN_OUTS 16
#define INTRIN_FOUTS 8

/* mma.cu: one m16n8k16 product per warp, twice (D = C + A0 B0 + A1 B1), matrices row-major in global memory */
struct mma_params {
    const unsigned short *a; /* [warps][2][16][16] fp16 bits */
    const unsigned short *b; /* [warps][2][16][8] fp16 bits, B[k][n] */
    const float *c;          /* [warps][16][8] */
    float *d;                /* [warps][16][8] */
};

/* bugs.cu */
struct bug_params {
    int *out;
    int mode; /* which bug, see bugs.cu */
};

/* bench.cu */
struct bench_params {
    int iters;
    unsigned *out;
};

/* unpack.cu: rows of 128 codes of `bits` bits (16 words a row whatever the width), 8 outputs per run */
struct unpack_params {
    const unsigned *rows;
    float *plain, *shifted, *inv; /* kvq_unpack8, kvq_unpack8_ps, kvq_preshift_inv */
    int n_rows, bits;
};

/* format.cu: templates/kvq_format.cuh. mode 0: x[i] -> codes[i] by kvq_fq_code of an element format without
 * group parameters (e4m3/e5m2 with T = 1) or kvq_e2m1_enc (kind -1); mode 1: codes[i] -> y[i] = L[codes[i]];
 * mode 2: n_groups groups of `group` values of x -> codes, s[g], z[g] by kvq_fq_group; mode 3: code i of packed
 * rows of 128 `bits`-bit codes at codes, written to codes[n + i] (kvq_fmt_code_at); mode 4: kvq_fmt_scale8 of
 * s[i] into codes[i] and kvq_fmt_ld_scale of it into y[i]. One item a thread. */
struct format_params {
    const float *x;
    unsigned char *codes;
    float *y, *s, *z;
    const float *levels;
    int mode, kind, bits, s_f32, n, group, normal, n_levels;
    float T;
};

#endif
