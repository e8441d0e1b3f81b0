"""Element formats (docs/language.md, "Element formats"): kvq's own quantizer and element codecs, called
through ctypes, so that kvq's codes and scales can be compared with other implementations (gguf-py's
quantizers, ml_dtypes' conversions) and used in experiments.

    codes, scales, zeros = quantize("q4_0", x)          # x: [..., n], n a multiple of the block (32)
    codes = encode("e4m3", x);  x2 = decode("e4m3", codes)

Codes are kvq's: an unsigned code per element in [0, 2^bits), decoded as x = zero + scale * T * L[code] with L
the format's level table (levels(...)); for the symmetric formats L[c] = c - 2^(bits-1) (q4_0: c - 8), so a
ggml q4_0 code q is kvq's code q, and a q8_0 value q (int8) is kvq's code q + 128."""
import ctypes

import numpy as np

from . import _lib

KINDS = ("int", "int_sym", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "e4m3", "e5m2", "nvfp4", "mxfp4", "codebook")
BLOCK = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "nvfp4": 16, "mxfp4": 32}
CODE_BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "e4m3": 8, "e5m2": 8, "nvfp4": 4, "mxfp4": 4}
MINIFLOATS = {"e4m3": 0, "e5m2": 1, "e2m1": 2, "e8m0": 3}
CODEBOOK_MAX = 16


class FormatCfg(ctypes.Structure):
    """compiler/scheme_format.h's kvq_format_cfg."""
    _fields_ = [("kind", ctypes.c_int), ("codebook_normal", ctypes.c_int), ("n_levels", ctypes.c_int),
                ("levels", ctypes.c_float * CODEBOOK_MAX), ("tensor_scale", ctypes.c_float)]


class QParams(ctypes.Structure):
    _fields_ = [("scale", ctypes.c_float), ("zero", ctypes.c_float)]


_P = ctypes.POINTER
_u8p, _f32p = _P(ctypes.c_uint8), _P(ctypes.c_float)
_quantize_group = _lib._fn("kvq_format_quantize_group", QParams, _P(FormatCfg), ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_float, _f32p, ctypes.c_size_t, ctypes.c_size_t, _u8p)
_levels = _lib._fn("kvq_format_levels", None, _P(FormatCfg), ctypes.c_int, _f32p)
_encode_n = _lib._fn("kvq_minifloat_encode_n", None, ctypes.c_int, _f32p, ctypes.c_size_t, _u8p)
_decode_n = _lib._fn("kvq_minifloat_decode_n", None, ctypes.c_int, _u8p, ctypes.c_size_t, _f32p)
_lloyd_max = _lib._fn("kvq_lloyd_max_normal", ctypes.c_int, ctypes.c_int, ctypes.c_double, _P(ctypes.c_double),
                      _P(ctypes.c_double))


def lloyd_max_normal(bits, sigma=1.0):
    """(levels, mse) of the Lloyd-Max quantizer for N(0, sigma^2) at `bits` bits (base/lloyd_max.h)."""
    lv = (ctypes.c_double * (1 << bits))()
    mse = ctypes.c_double()
    if _lloyd_max(bits, sigma, lv, ctypes.byref(mse)) != 0:
        raise ValueError("bits must be 1..8 and sigma > 0")
    return np.array(lv[:], dtype=np.float64), mse.value


def _cfg(fmt, bits, levels, tensor_scale):
    if fmt not in KINDS:
        raise ValueError("unknown format %r (one of %s)" % (fmt, ", ".join(KINDS)))
    c = FormatCfg(kind=KINDS.index(fmt), tensor_scale=tensor_scale)
    if fmt == "codebook":
        if isinstance(levels, str) and levels == "normal":
            lv, _ = lloyd_max_normal(bits)
            c.codebook_normal = 1
        else:
            lv = np.sort(np.asarray(levels, dtype=np.float32))
        if not 1 <= len(lv) <= min(CODEBOOK_MAX, 1 << bits):
            raise ValueError("a codebook at %d bits has 1..%d levels" % (bits, min(CODEBOOK_MAX, 1 << bits)))
        c.n_levels = len(lv)
        for i, v in enumerate(lv):
            c.levels[i] = float(v)
    return c


def quantize(fmt, x, bits=None, group=None, tensor_scale=1.0, levels=None, scale_dtype="fp16"):
    """Quantizes the last axis of x in groups (the format's block, else `group`) with kvq's quantizer.
    Returns (codes uint8 [..., n], scales float32 [..., n / group], zeros float32 [..., n / group]); scales and
    zeros are the stored values (fp16 for the q types, e4m3 for NVFP4, e8m0 for MXFP4), decoded to float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = CODE_BITS.get(fmt, bits)
    if bits is None:
        raise ValueError("format %r needs bits" % fmt)
    g = BLOCK.get(fmt, group or x.shape[-1])
    if x.shape[-1] % g:
        raise ValueError("the last axis (%d) is not a multiple of the group %d" % (x.shape[-1], g))
    cfg = _cfg(fmt, bits, levels, tensor_scale)
    flat = x.reshape(-1, g)
    codes = np.zeros(flat.shape, dtype=np.uint8)
    scales = np.zeros(flat.shape[0], dtype=np.float32)
    zeros = np.zeros(flat.shape[0], dtype=np.float32)
    dt = 1 if scale_dtype == "fp32" else 0
    for i in range(flat.shape[0]):
        row, out = flat[i], codes[i]
        p = _quantize_group(ctypes.byref(cfg), bits, dt, dt, tensor_scale, row.ctypes.data_as(_f32p), g, 1,
                            out.ctypes.data_as(_u8p))
        scales[i], zeros[i] = p.scale, p.zero
    shape = x.shape[:-1] + (x.shape[-1] // g,)
    return codes.reshape(x.shape), scales.reshape(shape), zeros.reshape(shape)


def levels(fmt, bits=None, codebook=None):
    """The level table L[0 .. 2^code_bits) of a format."""
    bits = CODE_BITS.get(fmt, bits)
    cfg = _cfg(fmt, bits, codebook, 1.0)
    out = np.zeros(1 << bits, dtype=np.float32)
    _levels(ctypes.byref(cfg), bits, out.ctypes.data_as(_f32p))
    return out


def encode(fmt, x):
    """The codes of x in e4m3 / e5m2 / e2m1 / e8m0 (base/minifloat.h): nearest even, saturating."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros(x.shape, dtype=np.uint8)
    _encode_n(MINIFLOATS[fmt], x.ctypes.data_as(_f32p), x.size, out.ctypes.data_as(_u8p))
    return out


def decode(fmt, codes):
    codes = np.ascontiguousarray(codes, dtype=np.uint8)
    out = np.zeros(codes.shape, dtype=np.float32)
    _decode_n(MINIFLOATS[fmt], codes.ctypes.data_as(_u8p), codes.size, out.ctypes.data_as(_f32p))
    return out
