/* The emulator runtime's own state, shared by exec.c (launch, blocks, scheduling, barriers, diagnostics),
 * warp.c (warp collectives) and cp_async.c. One launch runs at a time (see emu.h), on the launching thread. */
#ifndef EMU_INTERNAL_H
#define EMU_INTERNAL_H

#include <stdint.h>

#include "emu.h"
#include "emu_abi.h"
#include "fiber.h"

enum emu_tstate {
    T_UNSTARTED = 0, /* not yet run in this block */
    T_READY,         /* in the ready queue */
    T_RUNNING,
    T_WAIT_BAR,      /* waiting at a block barrier */
    T_WAIT_WARP,     /* waiting at a warp collective */
    T_EXITED
};

struct emu_copy {
    unsigned char *dst;
    unsigned size, group;
    unsigned char data[16];
};

struct emu_thr {
    struct emu_thread_pub pub; /* what the kernel reads; first so the pointers convert */
    enum emu_tstate state;
    struct emu_fiber *fiber;
    const char *wfile; /* where it waits (diagnostics, barrier matching) */
    int wline;
    int pred;
    const struct emu_warp_req *req;
    unsigned long long result;
    /* cp.async: copies issued and not yet landed; groups are numbered from 0, `open` is the uncommitted one. */
    struct emu_copy *cp;
    unsigned cp_n, cp_cap, cp_open;
};

struct emu_warpst {
    unsigned exists;  /* lanes the block has */
    unsigned exited;  /* lanes that returned */
    unsigned waiting; /* lanes waiting at a collective */
};

enum emu_mode { MODE_PLAIN, MODE_FIBERS };

struct emu_run {
    const struct emu_kernel *k;
    const void *params;
    struct emu_block_pub blk;
    size_t blk_smem; /* bytes of dynamic shared memory */
    unsigned n, nwarps;
    struct emu_thr *thr;
    struct emu_warpst *warps;
    unsigned *order, *queue;
    unsigned qhead, qlen;
    struct emu_thr *cur;
    enum emu_mode mode;
    unsigned plain_pos, exited;
    /* fibers: [0] runs the block plainly; the rest are handed out on promotion */
    struct emu_fiber main;
    struct emu_fiber *fibers;
    unsigned nfibers, fibers_used;
    size_t stack_size;
    /* block barrier */
    unsigned bar_n;
    const char *bar_file;
    int bar_line, bar_kind, bar_mismatch, bar_count, bar_and, bar_or, bar_result;
    /* shuffle */
    uint64_t rng;
    int shuffle;
    /* failure */
    emu_status status;
    char *msg;
    size_t msg_size;
    struct emu_stats st;
};

extern struct emu_run *emu_run_;

/* exec.c */
void emu_ready(struct emu_run *R, struct emu_thr *t);                 /* push onto the ready queue */
void emu_block_self(struct emu_run *R, struct emu_thr *t);            /* switch out until made ready again */
__attribute__((noreturn)) void emu_fail(struct emu_run *R, emu_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
uint64_t emu_rand(struct emu_run *R);
/* Appends to a message buffer, truncating with "..." when it is full. */
void emu_cat(char *buf, size_t size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Appends the ids i < n with bits[i] set, after `noun` or its plural: "thread 5", "lanes 0-3,8". */
void emu_cat_ids(char *buf, size_t size, const char *noun, const unsigned char *bits, unsigned n);

/* warp.c: the CUDA name of a warp collective, for messages */
const char *emu_warp_op_name(int op);

/* cp_async.c */
void emu_cp_reset(struct emu_thr *t);
void emu_cp_free(struct emu_thr *t);

/* Called after each thread block with its thread count and weight (the blocks it stands for: 1, or a sampled
 * launch's gridDim along the sampled dimension) when set (profile.c, a profiled module's counts). */
extern void (*emu_block_end_hook)(unsigned n_threads, unsigned long long weight);
/* Whether the launch running now is profiled ($KVQ_EMU_PROFILE_KERNELS; profile.c's hooks count only then). */
extern int emu_profiling;
/* The sampled launches so far ($KVQ_EMU_SAMPLE), for the profile's header (profile.c). */
#define EMU_SAMPLES 64
struct emu_sample_rec {
    char kernel[64];
    char dim;
    unsigned n;
};
extern struct emu_sample_rec emu_samples[EMU_SAMPLES];
extern int emu_n_samples;

#endif
