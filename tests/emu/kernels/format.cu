/* templates/kvq_format.cuh under the emulator: element encodes, level tables and group quantizers, one item a
 * thread (tests/emu/test_emu_format.c compares them with runtime/quant.c and base/minifloat.c). */
#define KVQ_D 128
#define KVQ_IN_DTYPE 0
#define KVQ_HKV 2
#include "kvq_format.cuh"
#include "params.h"

extern "C" __global__ void format_items(const struct format_params p)
{
    const int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= p.n) return;
    kvq_fq q;
    q.kind = p.kind, q.bits = p.bits, q.s_f32 = p.s_f32, q.z_f32 = p.s_f32, q.T = p.T;
    q.normal = p.normal, q.n_levels = p.n_levels, q.levels = p.levels;
    if (p.mode == 0)
        p.codes[i] = (unsigned char)(p.kind < 0 ? kvq_e2m1_enc(p.x[i]) : kvq_fq_code(&q, p.x[i], 1.0f, 0.0f));
    else if (p.mode == 1)
        p.y[i] = kvq_fmt_level(p.kind, kvq_fmt_code_bits(p.kind, p.bits), p.codes[i], p.levels, p.n_levels);
    else if (p.mode == 3) /* codes[i] of a packed row of 128 codes; y: the row bytes */
        p.codes[p.n + i] = (unsigned char)kvq_fmt_code_at(p.codes + (i / KVQ_D) * (KVQ_D * p.bits / 8), p.bits,
                                                           KVQ_D, i % KVQ_D);
    else if (p.mode == 4) { /* scale byte of s[i], and its value back */
        p.codes[i] = (unsigned char)kvq_fmt_scale8(p.kind, p.s[i]);
        p.y[i] = kvq_fmt_ld_scale(p.codes, i, p.kind, 1);
    } else
        kvq_fq_group(&q, p.x + (long long)i * p.group, p.group, 1, p.codes + (long long)i * p.group, p.s + i, p.z + i);
}
KVQ_KERNEL_EXPORT(format_items);
