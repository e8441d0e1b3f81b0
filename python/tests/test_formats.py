"""kvq's element formats bit for bit against each format's own reference implementation, on data generated
here: llama.cpp's block types against gguf-py's numpy quantizers (gguf.quants, the reference quantizers of
ggml-quants.c), the fp8 / fp4 element and scale conversions against ml_dtypes (float8_e4m3fn, float8_e5m2,
float4_e2m1fn, float8_e8m0fnu), and MXFP4 / NVFP4 blocks against their definitions composed from ml_dtypes'
conversions. Skipped, with the reason, where gguf or ml_dtypes is not installed."""
import numpy as np
import pytest

from kvq import formats

gguf_quants = pytest.importorskip("gguf.quants", reason="gguf (llama.cpp's gguf-py) is not installed")
import gguf  # noqa: E402

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")


def blocks(n_blocks, seed):
    """Blocks of 32 that exercise the rounding: normal data at several magnitudes, outliers, ties on the grid
    (small integers and halves), constant and all-zero blocks, a block whose largest magnitude is negative."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_blocks, 32)).astype(np.float32)
    x *= np.float32(10.0) ** rng.integers(-3, 3, size=(n_blocks, 1)).astype(np.float32)
    x[::7, 3] *= 40
    x[1::9] = np.round(x[1::9] * 2) / 2
    x[2::11] = rng.integers(-8, 8, size=(len(x[2::11]), 32))
    x[3] = 0
    x[4] = 1.5
    x[5] = np.linspace(-8, 7, 32)
    return x.astype(np.float32)


def ggml_codes(kind, raw):
    """(codes as kvq numbers them, fp16 d bits, fp16 m bits or None) from gguf's block bytes."""
    n = raw.shape[0]
    d = raw[:, 0:2].copy().view(np.uint16).reshape(n)
    if kind == "q8_0":
        return raw[:, 2:34].copy().view(np.int8).astype(np.int16) + 128, d, None
    off, m = 2, None
    if kind in ("q4_1", "q5_1"):
        m = raw[:, 2:4].copy().view(np.uint16).reshape(n)
        off = 4
    qh = None
    if kind in ("q5_0", "q5_1"):
        qh = np.unpackbits(raw[:, off:off + 4], axis=-1, bitorder="little")
        off += 4
    qs = raw[:, off:off + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)
    if qh is not None:
        q |= qh.astype(np.int16) << 4
    return q, d, m


def same_f16(a, b):
    """Equal fp16 bits, except that a zero's sign is not compared. A block of zeros has d = +-0, and which zero
    depends on the implementation, not on the format: ggml-quants.c starts from max = +0.0 (d = 0 / -8 = -0),
    gguf-py takes the block's first element (-0.0 / -8 = +0); numpy's min of 0.0 and -0.0 may return either.
    kvq follows ggml-quants.c. Every other bit is compared."""
    return (a == b) | (((a & 0x7FFF) == 0) & ((b & 0x7FFF) == 0))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_ggml_block_types_bit_identical(kind):
    x = blocks(3000, seed=hash(kind) & 0xFFFF)
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    raw = gguf_quants.quantize(x, qtype).reshape(len(x), -1)
    want_q, want_d, want_m = ggml_codes(kind, raw)
    codes, scales, zeros = formats.quantize(kind, x)
    got_d = scales.reshape(-1).astype(np.float16).view(np.uint16)
    bad = np.nonzero((codes.astype(np.int16) != want_q).any(axis=1) | ~same_f16(got_d, want_d))[0]
    assert bad.size == 0, "%s: %d blocks differ, first %d: kvq %s d %#x, ggml %s d %#x" % (
        kind, bad.size, bad[0], codes[bad[0]].tolist(), got_d[bad[0]], want_q[bad[0]].tolist(), want_d[bad[0]])
    if want_m is not None:
        got_m = zeros.reshape(-1).astype(np.float16).view(np.uint16)
        assert same_f16(got_m, want_m).all(), "%s: min differs" % kind
    # And the values decode the same: gguf's dequantization of its bytes equals kvq's z + s * L[code].
    L = formats.levels(kind)
    ours = zeros.reshape(-1, 1) + scales.reshape(-1, 1) * L[codes]
    theirs = gguf_quants.dequantize(raw.reshape(-1), qtype).reshape(x.shape)
    assert np.array_equal(ours.astype(np.float32), theirs.astype(np.float32)), kind


def in_range_values(maxv, seed, n=200000):
    """Random values across the whole exponent range below maxv, every representable value's neighbourhood and
    the exact midpoints (ties) between them."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.uniform(-24, np.log2(maxv), n)).astype(np.float32)
    x = np.where(rng.random(n) < 0.5, -mag, mag).astype(np.float32)
    return x[np.abs(x) <= maxv]


def grid_and_ties(dtype, maxv):
    codes = np.arange(256 if np.dtype(dtype).itemsize == 1 else 16, dtype=np.uint8)
    vals = np.unique(codes.view(dtype).astype(np.float32))
    vals = vals[np.isfinite(vals) & (np.abs(vals) <= maxv)]
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)
    nudge = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    return np.concatenate([vals, mids, nudge]).astype(np.float32)


@pytest.mark.parametrize("name,dtype,maxv", [("e4m3", "float8_e4m3fn", 448.0), ("e5m2", "float8_e5m2", 57344.0)])
def test_fp8_elements_match_ml_dtypes(name, dtype, maxv):
    dt = getattr(ml_dtypes, dtype)
    x = np.concatenate([in_range_values(maxv, 1), grid_and_ties(dt, maxv)])
    want = x.astype(dt).view(np.uint8)
    got = formats.encode(name, x)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, "%s: %d differ, e.g. %r -> kvq %#x, ml_dtypes %#x" % (name, bad.size, x[bad[0]], got[bad[0]],
                                                                                want[bad[0]])
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(dt).astype(np.float32)
    ok = np.isfinite(ref)
    assert np.array_equal(formats.decode(name, codes)[ok], ref[ok])


def test_e2m1_elements_match_ml_dtypes():
    dt = ml_dtypes.float4_e2m1fn
    x = np.concatenate([in_range_values(6.0, 2), grid_and_ties(dt, 6.0), np.float32([7, 1e9, -50])])
    want = x.astype(dt).view(np.uint8) & 0x0F  # ml_dtypes saturates e2m1 too
    got = formats.encode("e2m1", x)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, "e2m1: %d differ, e.g. %r -> kvq %#x, ml_dtypes %#x" % (bad.size, x[bad[0]], got[bad[0]],
                                                                                want[bad[0]])
    codes = np.arange(16, dtype=np.uint8)
    assert np.array_equal(formats.decode("e2m1", codes), codes.view(dt).astype(np.float32))


def test_e8m0_scales_match_ml_dtypes():
    rng = np.random.default_rng(3)
    # float32's normal range: ml_dtypes rounds float32 subnormals (below 2^-126) by their own rule.
    x = np.exp2(rng.uniform(-126, 126.9, 200000)).astype(np.float32)
    pw = np.exp2(np.arange(-126, 127, dtype=np.float64)).astype(np.float32)
    x = np.concatenate([x, pw, (pw * 1.5).astype(np.float32)[:-1]])
    want = x.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)
    got = formats.encode("e8m0", x)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, "e8m0: %d differ, e.g. %r -> kvq %d, ml_dtypes %d" % (bad.size, x[bad[0]], got[bad[0]],
                                                                               want[bad[0]])


def test_mxfp4_blocks_match_definition():
    """OCP MX v1.0 Sec. 6.3: X = 2^(floor(log2(amax)) - 2) in e8m0, P_i = e2m1(V_i / X)."""
    x = blocks(2000, seed=5)
    codes, scales, _ = formats.quantize("mxfp4", x)
    amax = np.abs(x).max(axis=1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    X = np.exp2(np.clip(e, -127, 127)).astype(np.float32)
    assert np.array_equal(scales.reshape(-1), X)
    assert np.array_equal(X.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32), X)
    want = (x / X[:, None]).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    assert np.array_equal(codes, want)


@pytest.mark.parametrize("T", [1.0, 0.0123])
def test_nvfp4_blocks_match_definition(T):
    """NVFP4: s = e4m3((amax_block / 6) / T), codes = e2m1(x / (s * T))."""
    x = blocks(2000, seed=6).reshape(-1, 16)
    x = x / np.float32(np.abs(x).max() / (6 * 448 * T))  # within the tensor scale's range
    x = x.astype(np.float32)
    codes, scales, _ = formats.quantize("nvfp4", x, tensor_scale=T)
    amax = np.abs(x).max(axis=1)
    s = ((amax / np.float32(6)) / np.float32(T)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(scales.reshape(-1), s)
    step = (s * np.float32(T)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = (x / step[:, None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0x0F
    want[step == 0] = 0
    assert np.array_equal(codes, want)


def test_normal_codebook_mse():
    """The `normal` codebook: Lloyd-Max levels whose MSE for N(0,1) is 0.3634, 0.1175, 0.03454, 0.009497
    (Max 1960; the converged optima are 0.0345478 and 0.0095010 at 3 and 4 bits)."""
    for bits, ref in zip((1, 2, 3, 4), (0.3634, 0.1175, 0.03454, 0.009497)):
        lv, mse = formats.lloyd_max_normal(bits)
        assert abs(mse - ref) <= 5e-4 * ref, (bits, mse)
        # Monte Carlo with kvq's quantizer (one group of 2^18 elements, scale = rms ~ 1).
        x = np.random.default_rng(bits).standard_normal(1 << 18).astype(np.float32)
        codes, scales, _ = formats.quantize("codebook", x[None, :], bits=bits, levels="normal", scale_dtype="fp32")
        xq = scales[0, 0] * formats.levels("codebook", bits, "normal")[codes[0]]
        emp = float(np.mean((x - xq) ** 2))
        assert abs(emp - mse) < 0.03 * mse + 1e-4, (bits, emp, mse)


@pytest.mark.parametrize("name,fmt", [("q4_0", "q4_0"), ("q5_1", "q5_1"), ("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"),
                                      ("fp8-e4m3", "e4m3")])
def test_engine_cache_is_the_formats_quantization(root, name, fmt):
    """A format spec through kvq.Engine: no backend named takes the cpu backend where this libkvq has one (it
    decodes every format), else the reference, and the cache read back is kvq.formats' quantization of the fp16
    input."""
    import os

    import kvq
    spec = os.path.join(root, "specs", "formats", name + ".kvq")
    H, T, D = 2, 48, 64
    rng = np.random.default_rng(7)
    k = (rng.standard_normal((H, T, D)) * 2).astype(np.float16).astype(np.float32)
    v = rng.standard_normal((H, T, D)).astype(np.float16).astype(np.float32)
    with kvq.Engine(spec, layers=1, heads=4, kv_heads=H, head_dim=D, scheme_name=name) as eng:
        assert eng.backend in ("cpu", "reference"), eng.backend
        seq = eng.sequence()
        eng.prefill(0, seq, k, v)
        rk, rv = eng.read_cache(seq, 0)
    wants = []
    for x, r in ((k, rk), (v, rv)):
        T_scale = 1.0
        if fmt in ("e4m3", "nvfp4"):  # tensor_scale prompt: amax / (largest element * largest block scale)
            T_scale = float(np.float32(np.abs(x).max()) / np.float32(448.0 if fmt == "e4m3" else 6.0 * 448.0))
        if fmt == "e4m3":
            want = (formats.decode("e4m3", formats.encode("e4m3", x / np.float32(T_scale))) *
                    np.float32(T_scale)).astype(np.float32)
        else:
            codes, scales, zeros = formats.quantize(fmt, x, tensor_scale=T_scale)
            g = formats.BLOCK[fmt]
            L = formats.levels(fmt)[codes].reshape(H, T, D // g, g)
            want = (zeros[..., None] + (scales[..., None] * np.float32(T_scale)) * L).reshape(H, T, D)
        assert np.array_equal(r, want.astype(np.float32)), (name, np.abs(r - want).max())
        wants.append(want.astype(np.float32))
    # The cpu backend runs every format (docs/cpu.md "Element formats"): its cache is the same bits.
    try:
        eng = kvq.Engine(spec, layers=1, heads=4, kv_heads=H, head_dim=D, backend="cpu", scheme_name=name)
    except kvq.KvqUnavailableError:
        return  # no cpu backend in this build / here
    with eng:
        seq = eng.sequence()
        eng.prefill(0, seq, k, v)
        for want, r in zip(wants, eng.read_cache(seq, 0)):
            assert np.array_equal(r, want), (name, "cpu", np.abs(r - want).max())
