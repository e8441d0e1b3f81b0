"""The measurement of `kvq eval` (tools/kvq/eval.c, docs/eval.md) in Python, on arrays in its .npy format:
prefill the first `prefill` tokens of every layer, decode the rest one token at a time with their queries, and
compare each decode step's attention output with exact attention over the fp16-rounded K/V (what the cache
stores). Same definitions, so the numbers agree with `kvq eval` on the same files."""
import numpy as np

from .core import Engine, load_scheme


def _rel(num, den):
    return float(np.sqrt(num / den)) if den > 0 else 0.0


def exact_attention(q, k, v, scale):
    """q [H, D] over k, v [HKV, n, D] (GQA: query head h reads kv head h // (H // HKV)); float64 [H, D]."""
    H, HKV = q.shape[0], k.shape[0]
    kk = np.repeat(k, H // HKV, axis=0).astype(np.float64)
    vv = np.repeat(v, H // HKV, axis=0).astype(np.float64)
    s = np.einsum("hd,hnd->hn", q.astype(np.float64), kk) * scale
    s -= s.max(axis=1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(axis=1, keepdims=True)
    return np.einsum("hn,hnd->hd", w, vv)


def evaluate(scheme, k, v, q, prefill=None, backend=None, seed=0):
    """k, v [L, HKV, T, D], q [L, H, T, D] (any float type). Returns a dict: attn_rel_err, attn_layer_rel_err
    (list), key_rel_err, value_rel_err, effective_bits, compression_ratio."""
    k, v, q = (np.asarray(x, dtype=np.float32) for x in (k, v, q))
    L, HKV, T, D = k.shape
    H = q.shape[1]
    N = prefill or T // 2
    # eval feeds the engine the files' type when K, V and Q agree (else float32) and rounds K, V to fp16 for the
    # reference; float32 in, fp16-rounded reference is the same on every path.
    k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    eng = Engine(load_scheme(scheme), L, H, HKV, D, backend=backend, dtype="float32", seed=seed)
    seq = eng.sequence()
    for layer in range(L):
        eng.prefill(layer, seq, k16[layer, :, :N], v16[layer, :, :N], q[layer, :, :N])
    scale = 1.0 / np.sqrt(D)
    lnum, lden = np.zeros(L), np.zeros(L)
    for t in range(N, T):
        for layer in range(L):
            out = eng.decode(layer, seq, k16[layer, :, t], v16[layer, :, t], q[layer, :, t])
            ref = exact_attention(q[layer, :, t], k16[layer, :, :t + 1], v16[layer, :, :t + 1], scale)
            lnum[layer] += ((out.astype(np.float64) - ref) ** 2).sum()
            lden[layer] += (ref ** 2).sum()
    knum = kden = vnum = vden = 0.0
    for layer in range(L):
        kc, vc = eng.read_cache(seq, layer)
        knum += ((kc.astype(np.float64) - k16[layer]) ** 2).sum()
        kden += (k16[layer].astype(np.float64) ** 2).sum()
        vnum += ((vc.astype(np.float64) - v16[layer]) ** 2).sum()
        vden += (v16[layer].astype(np.float64) ** 2).sum()
    m = eng.stats()
    eng.close()
    return {"attn_rel_err": _rel(lnum.sum(), lden.sum()),
            "attn_layer_rel_err": [_rel(a, b) for a, b in zip(lnum, lden)],
            "key_rel_err": _rel(knum, kden), "value_rel_err": _rel(vnum, vden),
            "effective_bits": m.effective_bits, "compression_ratio": m.compression_ratio}
