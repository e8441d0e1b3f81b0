"""kvq in transformers: a Cache whose layers are kvq engine layers, and the attention function that runs them.

    from kvq.hf import KvqCache
    out = model.generate(ids, cache=KvqCache("kivi2", model), max_new_tokens=32)

(`cache=`: transformers 5.x names the cache so; `past_key_values=` still works in 5.24 but is deprecated, with a
warning, and goes in 5.40 for model calls and 6.0 for generate. cache_kwarg(model) names what the installed
version takes.)

kvq's decode appends a token and attends inside the engine (kvq.h), so the cache cannot simply hand K/V back to
the model's attention: KvqCache(…, model) switches the model to the attention implementation "kvq" registered
here. For a layer of a KvqCache it computes the prompt's attention exactly in torch (kvq's prefill stores, it does
not attend: the prompt attends over itself unquantized, as in KIVI's prefill) and stores the prompt in the engine;
each later token goes through kvq_decode, one step per token. Other calls fall through to SDPA. Every batch row is
one kvq sequence; rows must not be padded (equal-length prompts)."""
import inspect

from ._deps import require_hf

require_hf("kvq.hf", exc=ImportError)

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from .core import Engine, load_scheme  # noqa: E402
from .errors import KvqError  # noqa: E402

ATTN_NAME = "kvq"


class KvqLayer(CacheLayerMixin):
    """One model layer's cache: the sequences live in the KvqCache's engine; this tracks the layer's length."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache, index):
        super().__init__()
        self.cache, self.index, self.length, self.pending = cache, index, 0, False

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending:
            raise KvqError("kvq: KvqCache layer %d was updated twice without attention: the model must use the "
                           "'kvq' attention implementation (pass the model to KvqCache, or call "
                           "kvq.hf.use_kvq_attention(model))" % self.index)
        self.pending = True
        # The attention function recognises a KvqCache layer's keys by this mark (a view: no copy).
        keys = key_states.view_as(key_states)
        keys._kvq_layer = self
        return keys, value_states

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    def reset(self):
        self.cache._free_sequences()

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("kvq: KvqCache does not support beam search")


class KvqCache(Cache):
    """A transformers Cache running a kvq scheme. spec: the name of a spec the package ships ("kivi2", "kivi4",
    "ott", ...: kvq.spec_names()), a .kvq path, spec text, a kvq.Spec or kvq.Scheme; scheme: the scheme's name
    when the spec has several. model: the model (its config gives the dims, and it is switched to the "kvq"
    attention); or config= alone (then call use_kvq_attention yourself). backend: None picks "cpu" when
    available, else "reference".

    The scheme is checked against the model's dims here (kvq_scheme_check_dims, the engine's own check): a group
    that does not divide head_dim, an unsupported head_dim or a spec's model block for another model raises
    KvqShapeError / KvqInvalidError now, not at the first forward."""

    def __init__(self, spec, model=None, config=None, scheme=None, backend=None, seed=0, threads=0):
        if model is None and config is None:
            raise ValueError("kvq: KvqCache needs the model (or its config)")
        cfg = (config or model.config)
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        self.scheme = load_scheme(spec, scheme)
        self.n_layers = cfg.num_hidden_layers
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scheme.check_dims(self.n_layers, self.heads, self.kv_heads, self.head_dim)
        self.backend, self.seed, self.threads = backend, seed, threads
        self.engine, self.seqs = None, []
        super().__init__(layers=[KvqLayer(self, i) for i in range(self.n_layers)])
        if model is not None:
            use_kvq_attention(model)

    def _engine(self, dtype, scaling):
        if self.engine is None:
            self.engine = Engine(self.scheme, self.n_layers, self.heads, self.kv_heads, self.head_dim,
                                 backend=self.backend, dtype=dtype, seed=self.seed,
                                 softmax_scale=float(scaling) if scaling else 0.0, threads=self.threads)
        return self.engine

    def _free_sequences(self):
        for s in self.seqs:
            s.close()
        self.seqs = []
        for layer in self.layers:
            layer.length, layer.pending = 0, False

    def stats(self):
        """The engine's memory statistics (kvq.MemStats), None before the first forward. What they count
        (docs/python.md, "Effective bits"): the cache as allocated now, every layer and batch row: quantized codes,
        their scales and zero points, fp16 windows and sinks, outlier pools at their capacity. effective_bits is
        device bits per stored K/V element (16 = plain fp16); host memory (a TailorKV sparse layer's whole prompt,
        kept in fp16 on the host) is not in it: host_bytes, and effective_bits_with_host counts it too. Short
        contexts are dominated by the fp16 windows (KIVI keeps the newest 128 tokens in fp16, allocated whole), so
        effective bits at 65 tokens exceed 16; they approach the scheme's nominal bits only when the context is long
        next to its windows."""
        return self.engine.stats() if self.engine else None

    def read_cache(self, layer, row=0):
        """The cache of one layer of one batch row as attention sees it: k, v [kv_heads, n, head_dim] float32."""
        return self.engine.read_cache(self.seqs[row], layer)


def _engine_dtype(t):
    return {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(t.dtype, "float32")


def _check_unpadded(mask, q_len, kv_len):
    """kvq sequences hold every token: a mask hiding anything but the future (padding) cannot be honoured."""
    if mask is None:
        return
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=allowed.device).tril(kv_len - q_len)
    if not torch.equal(allowed[..., -q_len:, -kv_len:], causal.expand_as(allowed[..., -q_len:, -kv_len:])):
        raise NotImplementedError("kvq: KvqCache supports unpadded batches only (equal-length prompts, no masking)")


def kvq_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [B, H, q, D]; key, value [B, HKV, q, D] (the new tokens). Returns ([B, q, H, D], None)."""
    layer = getattr(key, "_kvq_layer", None)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    cache, li = layer.cache, layer.index
    layer.pending = False
    B, H, q_len, D = query.shape
    eng = cache._engine(_engine_dtype(key), scaling)
    if layer.length == 0:
        # The prompt: exact attention in torch, then the engine stores it (one kvq sequence per batch row).
        _check_unpadded(attention_mask, q_len, q_len)
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
        while len(cache.seqs) < B:
            cache.seqs.append(eng.sequence())
        # the queries only where the layer needs them (ZipCache's probes, a calibration): no copy otherwise
        need_q = eng.prefill_needs_queries(li)
        eng.prefill_batch(li, [(cache.seqs[b], key[b], value[b], query[b] if need_q else None) for b in range(B)])
        layer.length = q_len
        return out, None
    if len(cache.seqs) != B:
        raise KvqError("kvq: the batch has %d rows, the cache %d sequences" % (B, len(cache.seqs)))
    _check_unpadded(attention_mask, q_len, layer.length + q_len)
    steps = []
    for t in range(q_len):  # causal: each token appends itself, then attends over the cache
        o = eng.decode_batch(li, [(cache.seqs[b], key[b, :, t], value[b, :, t], query[b, :, t]) for b in range(B)])
        steps.append(torch.from_numpy(o))
        layer.length += 1
    out = torch.stack(steps, dim=1).to(device=query.device, dtype=query.dtype)  # [B, q, H, D]
    return out, None


def cache_kwarg(model):
    """The name under which this transformers takes a cache: "cache" (5.x: past_key_values= is deprecated, with a
    warning on every call, and goes in 5.40), else "past_key_values" (older versions)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def use_kvq_attention(model):
    """Registers the "kvq" attention (and its mask: SDPA's) with transformers and switches the model to it."""
    AttentionInterface.register(ATTN_NAME, kvq_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_NAME)
        else:
            model.config._attn_implementation = ATTN_NAME
    return model
