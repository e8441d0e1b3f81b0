"""KvqCache in transformers' generate() on a small random Llama (GQA + RoPE): the fp16 scheme reproduces the
model's own logits and greedy tokens; KIVI-2 and KIVI-4 generate and lose in the order of their bits."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import kvq  # noqa: E402
from conftest import fresh_copy, spec  # noqa: E402
from kvq.hf import KvqCache  # noqa: E402

PROMPT, NEW = 300, 24  # longer than KIVI's 128-token fp16 residual window, so its body is quantized


def prompt(seed=1, batch=1, n=PROMPT):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, n), generator=g)


def generate(model, ids, cache=None):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, past_key_values=cache, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, dim=1).float()


def forced_logits(model, tokens, cache):
    """Logits of every position after the prompt with the given tokens fed back (teacher forcing): the prompt is
    prefilled, the rest decoded one token at a time through the cache. Comparable across schemes, unlike free
    generation, where one different token changes everything after it."""
    with torch.no_grad():
        model(input_ids=tokens[:, :PROMPT], past_key_values=cache, use_cache=True)
        return model(input_ids=tokens[:, PROMPT:], past_key_values=cache, use_cache=True).logits.float()


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
        model(input_ids=ids, past_key_values=cache, use_cache=True)
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
            model(input_ids=ids, attention_mask=mask, past_key_values=KvqCache(spec("kivi4"), model))


def test_bad_spec_in_cache_raises(tmp_path, tiny_llama):
    p = tmp_path / "oops.kvq"
    p.write_text("scheme oops {\n  residual -3;\n}\n")
    with pytest.raises(kvq.KvqSpecError, match=r"oops\.kvq:2:\d+"):
        KvqCache(str(p), fresh_copy(tiny_llama))
