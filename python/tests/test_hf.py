"""KvqCache in transformers' generate() on a small random Llama (GQA + RoPE): the fp16 scheme reproduces the
model's own logits and greedy tokens; KIVI-2 and KIVI-4 generate and lose in the order of their bits."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvq  # noqa: E402
from conftest import fresh_copy, spec  # noqa: E402
from kvq.hf import KvqCache, cache_kwarg  # noqa: E402

PROMPT, NEW = 300, 24  # longer than KIVI's 128-token fp16 residual window, so its body is quantized


def prompt(seed=1, batch=1, n=PROMPT):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


def generate(model, ids, cache=None):
    kw = {cache_kwarg(model): cache} if cache is not None else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits, dim=1).float()


def forced_logits(model, tokens, cache):
    """Logits of every position after the prompt with the given tokens fed back (teacher forcing): the prompt is
    prefilled, the rest decoded one token at a time through the cache. Comparable across schemes, unlike free
    generation, where one different token changes everything after it."""
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.no_grad():
        model(input_ids=tokens[:, :PROMPT], **kw)
        return model(input_ids=tokens[:, PROMPT:], **kw).logits.float()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return generate(fresh_copy(tiny_llama), prompt())


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_fp16_scheme_equals_transformers(tiny_llama, reference):
    ref_tokens, ref_logits = reference
    model = fresh_copy(tiny_llama)
    cache = KvqCache(spec("fp16"), model)
    tokens, logits = generate(model, prompt(), cache)
    assert torch.equal(tokens, ref_tokens)
    # The only difference: kvq stores K/V in fp16 (the model computes in fp32).
    assert rel(logits, ref_logits) < 2e-3
    torch.testing.assert_close(logits, ref_logits, rtol=1e-2, atol=1e-2)
    assert cache.get_seq_length() == PROMPT + NEW - 1  # the last token is never fed back
    assert cache.engine.backend in ("cpu", "reference")


def test_kivi_generates_and_errors_follow_bits(tiny_llama, reference):
    ref_tokens, _ = reference
    base = fresh_copy(tiny_llama)
    with torch.no_grad():
        ref_logits = base(input_ids=ref_tokens).logits[:, PROMPT:].float()
    errs, bits = {}, {}
    for name in ("fp16", "kivi4", "kivi2"):
        model = fresh_copy(tiny_llama)
        tokens, _ = generate(model, prompt(), KvqCache(spec(name), model))
        assert tokens.shape == ref_tokens.shape and torch.equal(tokens[:, :PROMPT], ref_tokens[:, :PROMPT])
        model = fresh_copy(tiny_llama)
        cache = KvqCache(spec(name), model)
        errs[name], bits[name] = rel(forced_logits(model, ref_tokens, cache), ref_logits), cache.stats().effective_bits
    assert errs["fp16"] < 2e-3
    assert errs["fp16"] < errs["kivi4"] < errs["kivi2"], errs
    assert bits["kivi2"] < bits["kivi4"] < bits["fp16"], bits
    assert errs["kivi2"] > 1e-3  # the quantized body is really used


def test_batch_rows_are_independent_sequences(tiny_llama):
    ids = prompt(seed=3, batch=2, n=160)
    model = fresh_copy(tiny_llama)
    both, _ = generate(model, ids, KvqCache(spec("kivi4"), model))
    for row in range(2):
        m = fresh_copy(tiny_llama)
        one, _ = generate(m, ids[row:row + 1], KvqCache(spec("kivi4"), m))
        assert torch.equal(both[row], one[0])


def test_cache_read_back_matches_model_keys(tiny_llama):
    from kvq.capture import capture_qkv
    ids = prompt(seed=4, n=64)
    K, V, Q, _ = capture_qkv(fresh_copy(tiny_llama), ids)
    model = fresh_copy(tiny_llama)
    cache = KvqCache(spec("fp16"), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    k, v = cache.read_cache(layer=1)
    torch.testing.assert_close(torch.from_numpy(k), torch.from_numpy(K[1]).half().float())
    torch.testing.assert_close(torch.from_numpy(v), torch.from_numpy(V[1]).half().float())


def test_padded_batch_is_refused(tiny_llama):
    ids = prompt(seed=5, batch=2, n=32)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    model = fresh_copy(tiny_llama)
    with pytest.raises(NotImplementedError, match="unpadded"):
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): KvqCache(spec("kivi4"), model)})


def test_bad_spec_in_cache_raises(tmp_path, tiny_llama):
    p = tmp_path / "oops.kvq"
    p.write_text("scheme oops {\n  residual -3;\n}\n")
    with pytest.raises(kvq.KvqSpecError, match=r"oops\.kvq:2:\d+"):
        KvqCache(str(p), fresh_copy(tiny_llama))


def test_documented_calls_warn_nothing(tiny_llama):
    """docs/python.md's calls (a shipped spec by name, cache=) on the installed transformers: no deprecation warning."""
    import warnings
    model = fresh_copy(tiny_llama)
    ids = prompt(seed=6, n=40)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                           pad_token_id=0, cache=KvqCache("kivi2", model))
            cache = KvqCache("kivi2", model)
            model(input_ids=ids, cache=cache, use_cache=True)
            model(input_ids=ids[:, :2], cache=cache, use_cache=True)
    assert not [w for w in seen if "deprecat" in str(w.message).lower()], [str(w.message) for w in seen]


def test_wrong_dims_refused_when_the_cache_is_built(tiny_llama):
    """OTT's value groups of 128 channels cannot split head_dim 64: KvqCache says so when it is made, with the
    library's reason, before any forward."""
    model = fresh_copy(tiny_llama)
    with pytest.raises(kvq.KvqShapeError, match=r"scheme 'ott' cannot run at layers 2, heads 4, kv_heads 2, "
                       r"head_dim 64: layer 0: value group 128 does not divide head_dim 64"):
        KvqCache("ott", model)
    assert model.config._attn_implementation == "sdpa"  # refused before the model was switched
    s = kvq.Spec.from_string("scheme big {\n  model { layers 32; heads 32; kv_heads 8; head_dim 128; }\n  bits 4;\n}\n")
    with pytest.raises(kvq.KvqShapeError, match="scheme 'big' is for layers 32"):
        KvqCache(s, model)


def test_shipped_specs_by_name(tiny_llama):
    names = kvq.spec_names()
    assert {"fp16", "kivi2", "kivi4", "ott", "tailorkv1", "zipcache"} <= set(names), names
    model = fresh_copy(tiny_llama)
    assert KvqCache("kivi4", model).scheme.name == "kivi4"
    assert kvq.load_scheme("compare/kivi2-g128").name == "kivi2-g128"  # includes kivi2: its own scheme
    with pytest.raises(kvq.KvqIOError, match="nor a spec the package ships"):
        KvqCache("kivi3", model)


def test_effective_bits_count_host_memory(tiny_llama, tmp_path):
    """A TailorKV layer forced sparse keeps the prompt in host memory: effective_bits (device) leaves it out,
    effective_bits_with_host counts it; both are what docs/python.md says."""
    p = tmp_path / "tk.kvq"
    p.write_text('include "%s";\nscheme tk1sparse : tailorkv1 {\n  layers 1..1 { mode sparse; }\n}\n'
                 % spec("tailorkv1"))
    model = fresh_copy(tiny_llama)
    cache = KvqCache(str(p), model, scheme="tk1sparse")
    forced_logits(model, prompt(seed=7, n=PROMPT + 8), cache)
    m = cache.stats()
    assert m.host_bytes > 0
    assert m.effective_bits_with_host == pytest.approx(16.0 * (m.device_bytes + m.host_bytes) / m.fp16_bytes)
    assert m.effective_bits == pytest.approx(16.0 * m.device_bytes / m.fp16_bytes)
    assert m.effective_bits_with_host > m.effective_bits
