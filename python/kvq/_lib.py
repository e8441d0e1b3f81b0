"""Loading libkvq.so and declaring the C API of kvq.h to ctypes (docs/python.md says why ctypes).

The library is looked up in this order: $KVQ_LIBRARY (a path), a copy bundled next to this file (pip install
from the checkout copies build/libkvq.so.0 when it exists), the build/ folder of the checkout this file sits in,
then the system's search path (after `make install`)."""
import ctypes
import ctypes.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    env = os.environ.get("KVQ_LIBRARY")
    if env:
        yield env
        return
    yield os.path.join(_HERE, "libkvq.so.0")
    yield os.path.join(_HERE, "..", "..", "build", "libkvq.so.0")
    found = ctypes.util.find_library("kvq")
    if found:
        yield found


def _load():
    tried = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(path + " (missing)")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
    raise ImportError("kvq: libkvq.so not found; build it with `make` in the kvq checkout, `make install`, or set "
                      "KVQ_LIBRARY to its path. Tried: " + "; ".join(tried or ["the system search path"]))


lib, path = _load()

c_int, c_double, c_size_t, c_char_p, c_void_p = ctypes.c_int, ctypes.c_double, ctypes.c_size_t, ctypes.c_char_p, \
    ctypes.c_void_p
c_uint64, c_float = ctypes.c_uint64, ctypes.c_float

SEG_COUNT = 9
SEGMENTS = ("sink", "body_high", "body_low", "params", "outlier", "spill", "residual", "sparse_local", "host")


class Diag(ctypes.Structure):
    _fields_ = [("file", c_char_p), ("line", c_int), ("col", c_int), ("severity", c_int), ("message", c_char_p),
                ("snippet", c_char_p), ("snippet_col", c_int)]


class Dims(ctypes.Structure):
    _fields_ = [("layers", c_int), ("heads", c_int), ("kv_heads", c_int), ("head_dim", c_int)]


class MemStats(ctypes.Structure):
    _fields_ = [("bytes", c_uint64 * SEG_COUNT), ("tokens", c_uint64 * SEG_COUNT), ("device_bytes", c_uint64),
                ("fp16_bytes", c_uint64), ("effective_bits", c_double), ("compression_ratio", c_double)]


class AccountOpts(ctypes.Structure):
    _fields_ = [("share_channel_params_across_batch", c_int), ("auto_sparse", ctypes.POINTER(ctypes.c_ubyte))]


class EngineConfig(ctypes.Structure):
    _fields_ = [("dims", Dims), ("backend", c_int), ("dtype", c_int), ("seed", c_uint64),
                ("softmax_scale", c_float), ("threads", c_int)]


class PrefillItem(ctypes.Structure):
    _fields_ = [("seq", c_void_p), ("n_tokens", c_int), ("k", c_void_p), ("v", c_void_p), ("q", c_void_p)]


class DecodeItem(ctypes.Structure):
    _fields_ = [("seq", c_void_p), ("k", c_void_p), ("v", c_void_p), ("q", c_void_p),
                ("out", ctypes.POINTER(c_float))]


def _fn(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


P = ctypes.POINTER
status_str = _fn("kvq_status_str", c_char_p, c_int)
version = _fn("kvq_version", c_char_p)
data_dir = _fn("kvq_data_dir", c_char_p)
spec_parse_file = _fn("kvq_spec_parse_file", c_int, c_char_p, P(c_void_p))
spec_parse_string = _fn("kvq_spec_parse_string", c_int, c_char_p, c_char_p, c_size_t, P(c_void_p))
spec_free = _fn("kvq_spec_free", None, c_void_p)
spec_diag_count = _fn("kvq_spec_diag_count", c_int, c_void_p)
spec_diag = _fn("kvq_spec_diag", P(Diag), c_void_p, c_int)
spec_error_count = _fn("kvq_spec_error_count", c_int, c_void_p)
diag_format = _fn("kvq_diag_format", c_size_t, P(Diag), c_char_p, c_size_t)
spec_scheme_count = _fn("kvq_spec_scheme_count", c_int, c_void_p)
spec_scheme_at = _fn("kvq_spec_scheme_at", c_void_p, c_void_p, c_int)
spec_scheme = _fn("kvq_spec_scheme", c_void_p, c_void_p, c_char_p)
scheme_name = _fn("kvq_scheme_name", c_char_p, c_void_p)
segment_name = _fn("kvq_segment_name", c_char_p, c_int)
scheme_account = _fn("kvq_scheme_account", c_int, c_void_p, P(Dims), c_int, c_int, P(AccountOpts), P(MemStats))
scheme_check_dims = _fn("kvq_scheme_check_dims", c_int, c_void_p, P(Dims), c_char_p, c_size_t)
backend_name = _fn("kvq_backend_name", c_char_p, c_int)
engine_config_init = _fn("kvq_engine_config_init", None, P(EngineConfig))
engine_create = _fn("kvq_engine_create", c_int, c_void_p, P(EngineConfig), P(c_void_p), c_char_p, c_size_t)
engine_free = _fn("kvq_engine_free", None, c_void_p)
engine_errmsg = _fn("kvq_engine_errmsg", c_char_p, c_void_p)
seq_create = _fn("kvq_seq_create", c_int, c_void_p, P(c_void_p))
seq_free = _fn("kvq_seq_free", None, c_void_p, c_void_p)
seq_length = _fn("kvq_seq_length", c_int, c_void_p, c_int)
prefill = _fn("kvq_prefill", c_int, c_void_p, c_int, P(PrefillItem), c_int)
prefill_needs_queries = _fn("kvq_prefill_needs_queries", c_int, c_void_p, c_int)
decode = _fn("kvq_decode", c_int, c_void_p, c_int, P(DecodeItem), c_int)
engine_stats = _fn("kvq_engine_stats", c_int, c_void_p, P(MemStats))
seq_stats = _fn("kvq_seq_stats", c_int, c_void_p, c_void_p, P(MemStats))
seq_read_cache = _fn("kvq_seq_read_cache", c_int, c_void_p, c_void_p, c_int, P(c_float), P(c_float), c_int, P(c_int))
calibrate_layer = _fn("kvq_calibrate_layer", c_int, c_void_p, c_int, c_int, c_void_p, c_void_p, P(c_double))
engine_layer_state = _fn("kvq_engine_layer_state", c_int, c_void_p, c_int)
engine_write_layer_map = _fn("kvq_engine_write_layer_map", c_int, c_void_p, c_char_p, c_char_p)
