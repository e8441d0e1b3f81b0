/* Warp collectives: __syncwarp, the four shuffles, votes, __reduce_*_sync and __match_*_sync. A lane waits only
 * for the lanes its mask names, in its own warp; when the last of them arrives the results of all are computed
 * at once and the others are made ready (the last one continues without a switch). What CUDA leaves undefined
 * is an error here: the caller missing from its mask, a mask naming lanes the block lacks or that exited, lanes
 * of one mask meeting at different kinds of collective or with different masks, widths or operand sizes. A
 * shuffle reading a lane outside the mask gets all-ones bits (NaN for floats) rather than a plausible value. */
#include <string.h>

#include "emu_half.h"
#include "emu_internal.h"

static const char *const op_names[EMU_W_NOPS] = {
    [EMU_W_SYNC] = "__syncwarp",         [EMU_W_IDX] = "__shfl_sync",
    [EMU_W_UP] = "__shfl_up_sync",       [EMU_W_DOWN] = "__shfl_down_sync",
    [EMU_W_XOR] = "__shfl_xor_sync",     [EMU_W_BALLOT] = "__ballot_sync",
    [EMU_W_ANY] = "__any_sync",          [EMU_W_ALL] = "__all_sync",
    [EMU_W_ADD] = "__reduce_add_sync",   [EMU_W_MIN_U] = "__reduce_min_sync",
    [EMU_W_MAX_U] = "__reduce_max_sync", [EMU_W_MIN_I] = "__reduce_min_sync",
    [EMU_W_MAX_I] = "__reduce_max_sync", [EMU_W_AND] = "__reduce_and_sync",
    [EMU_W_OR] = "__reduce_or_sync",     [EMU_W_XOR_R] = "__reduce_xor_sync",
    [EMU_W_MATCH_ANY] = "__match_any_sync", [EMU_W_MATCH_ALL] = "__match_all_sync",
    [EMU_W_MMA] = "mma.sync.m16n8k16",
};

const char *emu_warp_op_name(int op) { return op >= 0 && op < EMU_W_NOPS ? op_names[op] : "warp collective"; }

static int is_shuffle(int op) { return op >= EMU_W_IDX && op <= EMU_W_XOR; }

static void lanes_str(char *buf, size_t size, unsigned mask)
{
    unsigned char bits[32];
    for (unsigned i = 0; i < 32; i++) bits[i] = (mask >> i) & 1;
    buf[0] = 0;
    emu_cat_ids(buf, size, "lane", bits, 32);
}

/* Source lane of a shuffle as PTX shfl.sync defines it for CUDA's width argument: the segment mask is
 * 32 - width, the clamp 0 for .up and 31 otherwise; an out-of-range source reads the lane's own value. */
static unsigned shfl_src(int op, unsigned lane, unsigned b, unsigned width)
{
    unsigned seg = 32 - width, clamp = op == EMU_W_UP ? 0 : 31;
    int max_lane = (int)((lane & seg) | (clamp & ~seg)), min_lane = (int)(lane & seg);
    int j;
    b &= 31;
    switch (op) {
    case EMU_W_UP: j = (int)lane - (int)b; return j >= max_lane ? (unsigned)j : lane;
    case EMU_W_DOWN: j = (int)(lane + b); return j <= max_lane ? (unsigned)j : lane;
    case EMU_W_XOR: j = (int)(lane ^ b); return j <= max_lane ? (unsigned)j : lane;
    default: return (unsigned)(min_lane | (int)(b & ~seg));
    }
}

/* mma.sync.m16n8k16 (f16 x f16 + f32) over the 32 lanes' fragments, laid out as emu_abi.h documents. */
static void mma_m16n8k16(struct emu_thr *base)
{
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        const struct emu_mma_frag *f = (const struct emu_mma_frag *)(uintptr_t)base[l].req->value;
        unsigned g = l / 4, t = l % 4;
        for (unsigned h = 0; h < 2; h++) {
            A[g][2 * t + h] = emu_h2f((unsigned short)(f->a[0] >> 16 * h));
            A[g + 8][2 * t + h] = emu_h2f((unsigned short)(f->a[1] >> 16 * h));
            A[g][2 * t + 8 + h] = emu_h2f((unsigned short)(f->a[2] >> 16 * h));
            A[g + 8][2 * t + 8 + h] = emu_h2f((unsigned short)(f->a[3] >> 16 * h));
            B[2 * t + h][g] = emu_h2f((unsigned short)(f->b[0] >> 16 * h));
            B[2 * t + 8 + h][g] = emu_h2f((unsigned short)(f->b[1] >> 16 * h));
        }
    }
    for (unsigned l = 0; l < 32; l++) {
        struct emu_mma_frag *f = (struct emu_mma_frag *)(uintptr_t)base[l].req->value;
        unsigned g = l / 4, t = l % 4;
        for (unsigned e = 0; e < 4; e++) {
            unsigned i = g + 8 * (e / 2), j = 2 * t + e % 2;
            /* one fp32 rounding an add, k ascending: the build's -ffp-contract=off keeps the product and the add
             * apart, and without -ffast-math nothing reassociates them (the products are exact: 22 significant bits
             * at most). Plain floats: with `volatile` here test_cuda_tiles took 61.3 s under ASan, warm; 55.2 without. */
            float acc = f->c[e];
            for (unsigned k = 0; k < 16; k++) acc += A[i][k] * B[k][j];
            f->d[e] = acc;
        }
    }
}

static void compute(struct emu_thr *base, unsigned mask, int op)
{
    if (op == EMU_W_MMA) {
        mma_m16n8k16(base);
        for (unsigned l = 0; l < 32; l++) base[l].result = 0;
        return;
    }
    unsigned long long acc = 0;
    unsigned flags = 0;
    int first = 1;
    for (unsigned l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        const struct emu_warp_req *q = base[l].req;
        unsigned v32 = (unsigned)q->value;
        flags |= (unsigned)(q->value != 0) << l;
        switch (op) {
        case EMU_W_ADD: acc = (unsigned)(acc + v32); break;
        case EMU_W_MIN_U: acc = first || v32 < acc ? v32 : acc; break;
        case EMU_W_MAX_U: acc = first || v32 > acc ? v32 : acc; break;
        case EMU_W_MIN_I: acc = first || (int)v32 < (int)(unsigned)acc ? v32 : acc; break;
        case EMU_W_MAX_I: acc = first || (int)v32 > (int)(unsigned)acc ? v32 : acc; break;
        case EMU_W_AND: acc = first ? v32 : (acc & v32); break;
        case EMU_W_OR: acc |= v32; break;
        case EMU_W_XOR_R: acc ^= v32; break;
        default: break;
        }
        first = 0;
    }
    for (unsigned l = 0; l < 32; l++) {
        if (!(mask >> l & 1)) continue;
        struct emu_thr *t = &base[l];
        const struct emu_warp_req *q = t->req;
        unsigned long long r = 0;
        switch (op) {
        case EMU_W_SYNC: break;
        case EMU_W_IDX:
        case EMU_W_UP:
        case EMU_W_DOWN:
        case EMU_W_XOR: {
            unsigned j = shfl_src(op, l, (unsigned)q->arg, (unsigned)q->width);
            r = mask >> j & 1 ? base[j].req->value : ~0ull;
            break;
        }
        case EMU_W_BALLOT: r = flags; break;
        case EMU_W_ANY: r = flags != 0; break;
        case EMU_W_ALL: r = flags == mask; break;
        case EMU_W_MATCH_ANY:
        case EMU_W_MATCH_ALL: {
            unsigned same = 0;
            for (unsigned m = 0; m < 32; m++)
                if (mask >> m & 1 && base[m].req->value == q->value) same |= 1u << m;
            r = op == EMU_W_MATCH_ANY ? same : same == mask ? mask : 0;
            break;
        }
        default: r = acc; break;
        }
        t->result = r;
    }
}

unsigned long long emu_warp(const struct emu_warp_req *r)
{
    struct emu_run *R = emu_run_;
    struct emu_thr *t = R->cur;
    unsigned lane = t->pub.lane, me = 1u << lane, m = r->mask, w_idx = t->pub.linear >> 5;
    struct emu_warpst *w = &R->warps[w_idx];
    struct emu_thr *base = t - lane;
    const char *name = emu_warp_op_name(r->op);
    char lanes[160];
    R->st.warp_collectives++;
    if (r->op < 0 || r->op >= EMU_W_NOPS) emu_fail(R, EMU_ERR_WARP, "unknown warp collective %d", r->op);
    if (!(m & me))
        emu_fail(R, EMU_ERR_WARP, "%s at %s:%d: mask 0x%08x does not include the calling lane %u", name, r->file,
                 r->line, m, lane);
    if (m & ~w->exists) {
        lanes_str(lanes, sizeof lanes, m & ~w->exists);
        emu_fail(R, EMU_ERR_WARP, "%s at %s:%d: mask 0x%08x names %s, which warp %u of the block lacks", name,
                 r->file, r->line, m, lanes, w_idx);
    }
    if (m & w->exited) {
        lanes_str(lanes, sizeof lanes, m & w->exited);
        emu_fail(R, EMU_ERR_BARRIER, "%s at %s:%d: mask 0x%08x waits for %s of warp %u, which exited", name,
                 r->file, r->line, m, lanes, w_idx);
    }
    if (r->op == EMU_W_MMA && m != 0xffffffffu)
        emu_fail(R, EMU_ERR_WARP, "%s at %s:%d: mask 0x%08x: mma.sync.aligned needs all 32 lanes of the warp", name,
                 r->file, r->line, m);
    if (is_shuffle(r->op) && (r->width < 1 || r->width > 32 || (r->width & (r->width - 1))))
        emu_fail(R, EMU_ERR_WARP, "%s at %s:%d: width %d is not a power of 2 in 1..32", name, r->file, r->line,
                 r->width);
    t->req = r;
    t->wfile = r->file;
    t->wline = r->line;
    t->state = T_WAIT_WARP;
    w->waiting |= me;
    if ((w->waiting & m) != m) {
        emu_block_self(R, t);
        return t->result;
    }
    for (unsigned l = 0; l < 32; l++) {
        const struct emu_warp_req *q = base[l].req;
        if (!(m >> l & 1) || l == lane) continue;
        if (q->op != r->op || q->mask != m || q->size != r->size || (is_shuffle(r->op) && q->width != r->width))
            emu_fail(R, EMU_ERR_WARP,
                     "warp %u: lane %u at %s:%d (%s, mask 0x%08x, %u-byte operand, width %d) meets lane %u at %s:%d "
                     "(%s, mask 0x%08x, %u-byte operand, width %d)",
                     w_idx, lane, r->file, r->line, name, m, r->size, r->width, l, q->file, q->line,
                     emu_warp_op_name(q->op), q->mask, q->size, q->width);
    }
    compute(base, m, r->op);
    w->waiting &= ~m;
    unsigned others[32], n = 0;
    for (unsigned l = 0; l < 32; l++)
        if (m >> l & 1 && l != lane) others[n++] = l;
    for (unsigned i = n; R->shuffle && i > 1; i--) {
        unsigned j = (unsigned)(emu_rand(R) % i), x = others[i - 1];
        others[i - 1] = others[j];
        others[j] = x;
    }
    for (unsigned i = 0; i < n; i++) emu_ready(R, &base[others[i]]);
    t->state = T_RUNNING;
    return t->result;
}
