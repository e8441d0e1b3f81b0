"""The C API of kvq.h in Python: specs and schemes, engines and sequences, prefill and decode, statistics, the
cache read back, calibration. Tensors are numpy arrays or CPU torch tensors in the layouts kvq.h documents:

    prefill  k, v: [kv_heads, n_tokens, head_dim]   q: [heads, n_tokens, head_dim]
    decode   k, v: [kv_heads, head_dim]             q: [heads, head_dim]   -> out [heads, head_dim] float32

A wrong shape raises KvqShapeError naming the argument, the expected and the given shape, before the library is
called. Results come back as numpy arrays (torch.from_numpy() shares them without a copy)."""
import ctypes
import os
from dataclasses import dataclass, field

import numpy as np

from . import _lib
from .errors import (KvqError, KvqIOError, KvqShapeError, KvqSpecError, KvqUnavailableError, KvqUnsupportedError,
                     error_for)

BACKENDS = {"reference": 0, "cuda": 1, "emu": 2, "cpu": 3}
DTYPES = {"float32": 0, "float16": 1, "bfloat16": 2}
LAYER_STATES = {0: "quantized", 1: "sparse", 2: "undecided"}


def version():
    """The loaded libkvq's version."""
    return _lib.version().decode()


def data_dir():
    """Where the emu and cuda backends read templates and emulator sources (kvq_data_dir)."""
    return _lib.data_dir().decode()


def library_path():
    return _lib.path


# ---- the specs the package ships ---------------------------------------------------------------------------------

_HERE = os.path.dirname(os.path.abspath(__file__))


def specs_dir():
    """The folder of the paper specs: the copy installed with the package (kvq/specs, made by `pip install` from
    the checkout's specs/), else the checkout's specs/ when the package is used from its source tree."""
    for d in (os.path.join(_HERE, "specs"), os.path.join(_HERE, "..", "..", "specs")):
        if os.path.isfile(os.path.join(d, "kivi2.kvq")):
            return os.path.normpath(d)
    return None


def spec_names():
    """The names spec_path() knows: "kivi2", "ott", ..., "compare/kivi2-g128" (a path below specs_dir(), no .kvq)."""
    d = specs_dir()
    out = []
    if d:
        for sub, _, files in os.walk(d):
            rel = os.path.relpath(sub, d)
            out += [(f[:-4] if rel == "." else rel.replace(os.sep, "/") + "/" + f[:-4]) for f in files
                    if f.endswith(".kvq")]
    return sorted(out)


def spec_path(name):
    """The file of a shipped spec by name ("kivi2", "specs/kivi2.kvq" and "kivi2.kvq" name the same file)."""
    d = specs_dir()
    n = name[len("specs/"):] if name.startswith("specs/") else name
    n = n[:-4] if n.endswith(".kvq") else n
    if d and n in spec_names():
        return os.path.join(d, *n.split("/")) + ".kvq"
    raise KvqError("kvq: no spec named '%s'; the package ships %s" % (
        name, ", ".join(spec_names()) or "none (no kvq/specs in this install)"))


def _check(status, message_fn):
    if status != 0:
        raise error_for(status, message_fn())


# ---- specs -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Diagnostic:
    file: str
    line: int
    col: int
    severity: str  # "error", "warning", "note"
    message: str
    snippet: str = None

    def __str__(self):
        return "%s:%d:%d: %s: %s" % (self.file, self.line, self.col, self.severity, self.message)


class Spec:
    """A parsed .kvq spec. Spec.from_file / Spec.from_string raise KvqSpecError (carrying every diagnostic, the
    first as file:line:col) when the spec has errors; warnings are kept in .diagnostics."""

    def __init__(self, handle):
        self._h = handle

    @classmethod
    def _parse(cls, call, what):
        h = ctypes.c_void_p()
        st = call(ctypes.byref(h))
        spec = cls(h) if h.value else None
        if st != 0:
            diags = spec.diagnostics if spec else []
            errors = [d for d in diags if d.severity == "error"] or diags
            if spec:
                spec.close()
            msg = str(errors[0]) if errors else "%s: %s" % (what, _lib.status_str(st).decode())
            if len(errors) > 1:
                msg += " (and %d more error%s)" % (len(errors) - 1, "s" if len(errors) > 2 else "")
            if st == 1:
                raise KvqSpecError(msg, diags)
            e = error_for(st, msg)
            e.diagnostics = diags
            raise e
        return spec

    @classmethod
    def from_file(cls, path):
        p = os.fsencode(path)
        return cls._parse(lambda out: _lib.spec_parse_file(p, out), os.fsdecode(path))

    @classmethod
    def from_string(cls, text, name="<string>"):
        b = text.encode() if isinstance(text, str) else bytes(text)
        return cls._parse(lambda out: _lib.spec_parse_string(name.encode(), b, len(b), out), name)

    def close(self):
        if self._h:
            _lib.spec_free(self._h)
            self._h = None

    def __del__(self):
        self.close()

    @property
    def diagnostics(self):
        out = []
        sev = {0: "error", 1: "warning", 2: "note"}
        for i in range(_lib.spec_diag_count(self._h)):
            d = _lib.spec_diag(self._h, i).contents
            out.append(Diagnostic((d.file or b"").decode(), d.line, d.col, sev.get(d.severity, "note"),
                                  (d.message or b"").decode(), d.snippet.decode() if d.snippet else None))
        return out

    @property
    def schemes(self):
        return [Scheme(self, _lib.spec_scheme_at(self._h, i)) for i in range(_lib.spec_scheme_count(self._h))]

    def scheme(self, name=None):
        """The scheme called `name`; None: the spec's only scheme."""
        h = _lib.spec_scheme(self._h, name.encode() if name else None)
        if not h:
            names = [s.name for s in self.schemes]
            if name is None:
                raise KeyError("the spec has %d schemes (%s): name one" % (len(names), ", ".join(names)))
            raise KeyError("no scheme '%s' in the spec (it has %s)" % (name, ", ".join(names)))
        return Scheme(self, h)


@dataclass
class MemStats:
    """kvq_mem_stats: bytes and token slots by segment (kvq_segment names), device bytes, the fp16 equivalent,
    effective bits per stored element and the compression ratio."""
    bytes: dict
    tokens: dict
    device_bytes: int
    fp16_bytes: int
    effective_bits: float
    compression_ratio: float

    @property
    def host_bytes(self):
        """Bytes kept in host memory, not on the device: a TailorKV sparse layer's whole prompt in fp16."""
        return self.bytes["host"]

    @property
    def effective_bits_with_host(self):
        """effective_bits with the host bytes counted too: bits per stored K/V element of device and host memory."""
        return 16.0 * (self.device_bytes + self.host_bytes) / self.fp16_bytes if self.fp16_bytes else 0.0

    @classmethod
    def _from_c(cls, m):
        return cls({_lib.SEGMENTS[i]: int(m.bytes[i]) for i in range(_lib.SEG_COUNT)},
                   {_lib.SEGMENTS[i]: int(m.tokens[i]) for i in range(_lib.SEG_COUNT)},
                   int(m.device_bytes), int(m.fp16_bytes), float(m.effective_bits), float(m.compression_ratio))


class Scheme:
    """A resolved scheme; keeps its spec alive."""

    def __init__(self, spec, handle):
        self.spec, self._h = spec, handle

    @property
    def name(self):
        return _lib.scheme_name(self._h).decode()

    def __repr__(self):
        return "Scheme(%r)" % self.name

    def check_dims(self, layers, heads, kv_heads, head_dim):
        """Raises KvqShapeError / KvqInvalidError when the scheme cannot run at these dims (a group that does not
        divide head_dim, an unsupported head_dim, a model block that disagrees, ...): kvq_scheme_check_dims, the
        check the engine, the accounting and the tools share."""
        dims = _lib.Dims(layers, heads, kv_heads, head_dim)
        msg = ctypes.create_string_buffer(512)
        st = _lib.scheme_check_dims(self._h, ctypes.byref(dims), msg, len(msg))
        _check(st, lambda: "kvq: scheme '%s' cannot run at layers %d, heads %d, kv_heads %d, head_dim %d: %s" % (
            self.name, layers, heads, kv_heads, head_dim, msg.value.decode()))

    def account(self, layers, heads, kv_heads, head_dim, batch=1, seq=4096, share_channel_params_across_batch=False,
                auto_sparse=None):
        """Memory of the cache after a prefill of `seq` tokens (kvq_scheme_account), without running anything."""
        dims = _lib.Dims(layers, heads, kv_heads, head_dim)
        opts = _lib.AccountOpts(int(bool(share_channel_params_across_batch)), None)
        keep = None
        if auto_sparse is not None:
            keep = (ctypes.c_ubyte * layers)(*[1 if x else 0 for x in auto_sparse])
            opts.auto_sparse = ctypes.cast(keep, ctypes.POINTER(ctypes.c_ubyte))
        m = _lib.MemStats()
        st = _lib.scheme_account(self._h, ctypes.byref(dims), batch, seq, ctypes.byref(opts), ctypes.byref(m))
        _check(st, lambda: "account %s: %s" % (self.name, _lib.status_str(st).decode()))
        return MemStats._from_c(m)


def load_spec(spec_or_path):
    """A Spec from a Spec, spec text (anything containing '{'), a path to a .kvq file, or the name of a spec the
    package ships ("kivi2", "ott", "compare/kivi2-g128": spec_names()). A path that exists wins over a name."""
    if isinstance(spec_or_path, Spec):
        return spec_or_path
    s = os.fspath(spec_or_path)
    if "{" in s:
        return Spec.from_string(s)
    if not os.path.exists(s):
        try:
            s = spec_path(s)
        except KvqError:
            raise KvqIOError("kvq: %s: no such file, nor a spec the package ships (%s)" % (
                s, ", ".join(spec_names()) or "none")) from None
    return Spec.from_file(s)


def load_scheme(spec_or_path, name=None):
    """A Scheme from a Scheme, or anything load_spec takes; name: the scheme's name when the spec has several."""
    if isinstance(spec_or_path, Scheme):
        return spec_or_path
    spec = load_spec(spec_or_path)
    if name is None and isinstance(spec_or_path, str) and "{" not in spec_or_path and len(spec.schemes) > 1:
        # A shipped spec that includes another ("compare/kivi2-g128" includes kivi2) names its own scheme.
        base = os.path.basename(spec_or_path)
        base = base[:-4] if base.endswith(".kvq") else base
        if base in [sc.name for sc in spec.schemes] and not os.path.exists(spec_or_path):
            name = base
    return spec.scheme(name)


# ---- tensors -----------------------------------------------------------------------------------------------------

def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _dtype_code(dtype):
    if isinstance(dtype, int):
        return dtype
    s = str(dtype).replace("torch.", "")
    s = {"float": "float32", "half": "float16", "f4": "float32", "f2": "float16"}.get(s, s)
    try:
        return DTYPES[np.dtype(s).name if s != "bfloat16" else s]
    except (TypeError, KeyError):
        raise KvqError("kvq: dtype %s is not float32, float16 or bfloat16" % (dtype,)) from None


class _Buf:
    """A tensor as the engine wants it (its dtype, C order, on the CPU), and the object that keeps it alive."""
    __slots__ = ("keep", "ptr")

    def __init__(self, x, code, shape, what):
        if tuple(x.shape) != tuple(shape):
            raise KvqShapeError("kvq: %s has shape %s; expected %s" % (
                what[0], tuple(int(s) for s in x.shape), "(" + ", ".join(what[1]) + ")"))
        if _is_torch(x):
            import torch
            tdt = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}[code]
            t = x.detach().to(device="cpu", dtype=tdt).contiguous()
            self.keep, self.ptr = t, t.data_ptr()
        else:
            if code == 2:
                a = np.asarray(x)
                if a.dtype != np.uint16:
                    raise KvqError("kvq: a bfloat16 engine takes torch tensors, or numpy uint16 holding the bits")
                a = np.ascontiguousarray(a)
            else:
                a = np.ascontiguousarray(x, dtype=np.float32 if code == 0 else np.float16)
            self.keep, self.ptr = a, a.ctypes.data


# ---- engines -----------------------------------------------------------------------------------------------------

class Sequence:
    """One sequence's cache in an engine (kvq_seq). Freed by close() or with its engine."""

    def __init__(self, engine, handle):
        self.engine, self._h = engine, handle

    def close(self):
        if self._h and self.engine._h:
            _lib.seq_free(self.engine._h, self._h)
            self.engine._seqs.discard(self)
        self._h = None

    def __len__(self):
        return self.length(0)

    def length(self, layer=0):
        """Tokens held in `layer` (prefilled + decoded)."""
        return _lib.seq_length(self._handle(), layer)

    def _handle(self):
        if not self._h or not self.engine._h:
            raise KvqError("kvq: the sequence was freed")
        return self._h

    def stats(self):
        return self.engine.stats(self)

    def read_cache(self, layer):
        return self.engine.read_cache(self, layer)


class Engine:
    """An engine running a scheme for one model's dims (kvq_engine).

    backend: "cpu" (the default when this libkvq has it), "reference", "emu" or "cuda". dtype: of every tensor
    passed in ("float32", "float16", "bfloat16", or a numpy/torch dtype); tensors of another type are converted."""

    def __init__(self, scheme, layers, heads, kv_heads, head_dim, backend=None, dtype="float32", seed=0,
                 softmax_scale=0.0, threads=0, scheme_name=None):
        self.scheme = load_scheme(scheme, scheme_name)
        self.layers, self.heads, self.kv_heads, self.head_dim = layers, heads, kv_heads, head_dim
        self.dtype = _dtype_code(dtype)
        self._h = None
        self._seqs = set()
        tries = [backend] if backend else ["cpu", "reference"]
        for i, b in enumerate(tries):
            if b not in BACKENDS:
                raise KvqError("kvq: unknown backend '%s' (%s)" % (b, ", ".join(BACKENDS)))
            cfg = _lib.EngineConfig()
            _lib.engine_config_init(ctypes.byref(cfg))
            cfg.dims = _lib.Dims(layers, heads, kv_heads, head_dim)
            cfg.backend, cfg.dtype, cfg.seed = BACKENDS[b], self.dtype, seed
            cfg.softmax_scale, cfg.threads = softmax_scale, threads
            h = ctypes.c_void_p()
            err = ctypes.create_string_buffer(1024)
            st = _lib.engine_create(self.scheme._h, ctypes.byref(cfg), ctypes.byref(h), err, len(err))
            if st == 0:
                self._h, self.backend = h, b
                return
            e = error_for(st, "kvq: engine for scheme '%s': %s" % (self.scheme.name, err.value.decode()))
            # No backend named: the cpu backend when this library has one and it runs here, else the reference.
            if i + 1 < len(tries) and isinstance(e, (KvqUnavailableError, KvqUnsupportedError)):
                continue
            raise e

    def close(self):
        if self._h:
            for s in list(self._seqs):
                s._h = None
            self._seqs.clear()
            _lib.engine_free(self._h)
            self._h = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _handle(self):
        if not self._h:
            raise KvqError("kvq: the engine was closed")
        return self._h

    def _fail(self, st, what):
        raise error_for(st, "kvq: %s: %s" % (what, _lib.engine_errmsg(self._h).decode()))

    def sequence(self):
        h = ctypes.c_void_p()
        st = _lib.seq_create(self._handle(), ctypes.byref(h))
        if st:
            self._fail(st, "sequence")
        s = Sequence(self, h.value)
        self._seqs.add(s)
        return s

    def _layer(self, layer):
        if not 0 <= layer < self.layers:
            raise KvqError("kvq: layer %d is not in 0..%d" % (layer, self.layers - 1))

    def prefill_needs_queries(self, layer):
        """Whether prefill of `layer` needs the prompt's queries now (saliency probes, or a calibration still to
        come); when False, q may be None and the host need not gather them."""
        self._handle()
        self._layer(layer)
        return _lib.prefill_needs_queries(self._h, layer) == 1

    def prefill(self, layer, seq, k, v, q=None):
        """Prefill of one layer of one sequence: k, v [kv_heads, n, head_dim], q [heads, n, head_dim] or None."""
        self.prefill_batch(layer, [(seq, k, v, q)])

    def prefill_batch(self, layer, items):
        """items: (seq, k, v, q) tuples, each sequence with its own length."""
        self._handle()
        self._layer(layer)
        arr = (_lib.PrefillItem * len(items))()
        keep = []
        HKV, H, D = self.kv_heads, self.heads, self.head_dim
        for i, (seq, k, v, q) in enumerate(items):
            n = int(k.shape[1]) if len(k.shape) == 3 else -1
            kb = _Buf(k, self.dtype, (HKV, n if n >= 0 else 0, D), ("k", ("kv_heads=%d" % HKV, "n_tokens", "head_dim=%d" % D)))
            vb = _Buf(v, self.dtype, (HKV, n, D), ("v", ("kv_heads=%d" % HKV, "n_tokens=%d" % n, "head_dim=%d" % D)))
            qb = _Buf(q, self.dtype, (H, n, D), ("q", ("heads=%d" % H, "n_tokens=%d" % n, "head_dim=%d" % D))) \
                if q is not None else None
            keep += [kb, vb, qb]
            arr[i] = _lib.PrefillItem(seq._handle(), n, kb.ptr, vb.ptr, qb.ptr if qb else None)
        st = _lib.prefill(self._h, layer, arr, len(items))
        if st:
            self._fail(st, "prefill layer %d" % layer)

    def decode(self, layer, seq, k, v, q):
        """One decode step of one layer: appends k, v [kv_heads, head_dim] and attends with q [heads, head_dim].
        Returns the attention output, [heads, head_dim] float32."""
        return self.decode_batch(layer, [(seq, k, v, q)])[0]

    def decode_batch(self, layer, items):
        """items: (seq, k, v, q) tuples; returns [n_items, heads, head_dim] float32."""
        self._handle()
        self._layer(layer)
        HKV, H, D = self.kv_heads, self.heads, self.head_dim
        out = np.empty((len(items), H, D), dtype=np.float32)
        arr = (_lib.DecodeItem * len(items))()
        keep = []
        for i, (seq, k, v, q) in enumerate(items):
            kb = _Buf(k, self.dtype, (HKV, D), ("k", ("kv_heads=%d" % HKV, "head_dim=%d" % D)))
            vb = _Buf(v, self.dtype, (HKV, D), ("v", ("kv_heads=%d" % HKV, "head_dim=%d" % D)))
            qb = _Buf(q, self.dtype, (H, D), ("q", ("heads=%d" % H, "head_dim=%d" % D)))
            keep += [kb, vb, qb]
            arr[i] = _lib.DecodeItem(seq._handle(), kb.ptr, vb.ptr, qb.ptr,
                                     out[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        st = _lib.decode(self._h, layer, arr, len(items))
        if st:
            self._fail(st, "decode layer %d" % layer)
        return out

    def stats(self, seq=None):
        """Memory of the cache as allocated now: every live sequence, or one."""
        m = _lib.MemStats()
        st = _lib.engine_stats(self._handle(), ctypes.byref(m)) if seq is None else \
            _lib.seq_stats(self._h, seq._handle(), ctypes.byref(m))
        if st:
            self._fail(st, "stats")
        return MemStats._from_c(m)

    def read_cache(self, seq, layer):
        """The cache of (seq, layer) as attention sees it: k, v [kv_heads, n_tokens, head_dim] float32."""
        self._layer(layer)
        cap = max(seq.length(layer), 1)
        k = np.empty((self.kv_heads, cap, self.head_dim), dtype=np.float32)
        v = np.empty_like(k)
        n = ctypes.c_int()
        fp = ctypes.POINTER(ctypes.c_float)
        st = _lib.seq_read_cache(self._handle(), seq._handle(), layer, k.ctypes.data_as(fp), v.ctypes.data_as(fp),
                                 cap, ctypes.byref(n))
        if st:
            self._fail(st, "read_cache layer %d" % layer)
        return k[:, :n.value].copy(), v[:, :n.value].copy()

    def calibrate_layer(self, layer, k, q):
        """TailorKV offline identification for a layer whose mode is auto: k [kv_heads, n, D], q [heads, n, D].
        Returns the dense preference score; the layer's state then says what it decided."""
        self._layer(layer)
        n = int(k.shape[1]) if len(k.shape) == 3 else 0
        kb = _Buf(k, self.dtype, (self.kv_heads, n, self.head_dim), ("k", ("kv_heads", "n_tokens", "head_dim")))
        qb = _Buf(q, self.dtype, (self.heads, n, self.head_dim), ("q", ("heads", "n_tokens=%d" % n, "head_dim")))
        score = ctypes.c_double()
        st = _lib.calibrate_layer(self._handle(), layer, n, kb.ptr, qb.ptr, ctypes.byref(score))
        if st:
            self._fail(st, "calibrate layer %d" % layer)
        return score.value

    def layer_state(self, layer):
        """"quantized", "sparse" or "undecided"."""
        self._layer(layer)
        return LAYER_STATES[_lib.engine_layer_state(self._handle(), layer)]

    def write_layer_map(self, path, name):
        st = _lib.engine_write_layer_map(self._handle(), os.fsencode(path), name.encode())
        if st:
            self._fail(st, "write_layer_map")
