"""The C API through the kvq package: specs and diagnostics, engines, prefill/decode against exact attention,
statistics, read_cache, calibration and the status codes as exception types. numpy only."""
import os
import re

import numpy as np
import pytest

import kvq
from conftest import ROOT, spec
from kvq.evaluate import exact_attention

L, H, HKV, D = 2, 4, 2, 64


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_version_is_kvq_h():
    with open(os.path.join(ROOT, "runtime", "include", "kvq.h")) as f:
        want = re.search(r'#define KVQ_VERSION "(.*)"', f.read()).group(1)
    assert kvq.version() == want


def test_bad_spec_raises_with_file_line_col(tmp_path):
    p = tmp_path / "bad.kvq"
    p.write_text("scheme broken {\n  key { bits 2; per channel; group 32; }\n  value { bits 5; }\n}\n")
    with pytest.raises(kvq.KvqSpecError) as e:
        kvq.Spec.from_file(str(p))
    assert re.match(r".*bad\.kvq:3:\d+: error: ", str(e.value)), str(e.value)
    assert e.value.line == 3 and e.value.col > 0 and e.value.file.endswith("bad.kvq")
    assert e.value.diagnostics[0].severity == "error"


def test_bad_spec_string_and_missing_file():
    with pytest.raises(kvq.KvqSpecError, match=r"^inline\.kvq:1:\d+: error"):
        kvq.Spec.from_string("scheme x { bits; }", "inline.kvq")
    with pytest.raises(kvq.KvqIOError):
        kvq.Spec.from_file("/nonexistent/x.kvq")


def test_wrong_shape_raises_clear_error():
    eng = kvq.Engine(spec("kivi4"), L, H, HKV, D, backend="reference")
    seq = eng.sequence()
    with pytest.raises(kvq.KvqShapeError, match=r"k has shape \(3, 10, 64\); expected \(kv_heads=2"):
        eng.prefill(0, seq, rand(3, 10, D), rand(HKV, 10, D))
    eng.prefill(0, seq, rand(HKV, 10, D), rand(HKV, 10, D))
    with pytest.raises(kvq.KvqShapeError, match=r"q has shape \(4, 32\); expected \(heads=4, head_dim=64\)"):
        eng.decode(0, seq, rand(HKV, D), rand(HKV, D), rand(H, 32))


def test_prefill_needs_queries():
    eng = kvq.Engine(spec("kivi4"), L, H, HKV, D, backend="reference")
    assert not eng.prefill_needs_queries(0)  # KIVI: no saliency, nothing to calibrate
    seq = eng.sequence()
    eng.prefill(0, seq, rand(HKV, 10, D), rand(HKV, 10, D))  # and q may be None
    zc = kvq.Engine(spec("zipcache"), L, H, HKV, D, backend="reference")
    assert zc.prefill_needs_queries(L - 1)  # ZipCache's probes
    with pytest.raises(kvq.KvqInvalidError, match="probes"):
        zc.prefill(0, zc.sequence(), rand(HKV, 10, D), rand(HKV, 10, D))
    with pytest.raises(kvq.KvqError, match="layer"):
        eng.prefill_needs_queries(L)


def test_status_codes_are_exception_types():
    eng = kvq.Engine(spec("kivi4"), L, H, HKV, D, backend="reference")
    seq = eng.sequence()
    with pytest.raises(kvq.KvqStateError, match="prefill"):  # decode before the layer's prefill
        eng.decode(0, seq, rand(HKV, D), rand(HKV, D), rand(H, D))
    with pytest.raises(kvq.KvqShapeError, match="head_dim 50"):  # not a supported head_dim
        kvq.Engine(spec("kivi4"), L, H, HKV, 50, backend="reference")
    with pytest.raises(kvq.KvqUnavailableError):  # no GPU, no driver here (or a GPU: skip)
        try:
            kvq.Engine(spec("kivi4"), L, H, HKV, D, backend="cuda")
        except kvq.KvqUnavailableError:
            raise
        else:
            pytest.skip("a GPU is present: the cuda backend runs")
    assert issubclass(kvq.KvqShapeError, ValueError) and issubclass(kvq.KvqSpecError, kvq.KvqError)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_fp16_decode_is_exact_attention(backend):
    eng = kvq.Engine(spec("fp16"), L, H, HKV, D, backend=backend)
    assert eng.backend in ("cpu", "reference")
    seq = eng.sequence()
    T, N = 40, 24
    k, v, q = rand(L, HKV, T, D, seed=1), rand(L, HKV, T, D, seed=2), rand(L, H, T, D, seed=3)
    k16, v16 = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
    for layer in range(L):
        eng.prefill(layer, seq, k[layer, :, :N], v[layer, :, :N], q[layer, :, :N])
    for t in range(N, T):
        for layer in range(L):
            out = eng.decode(layer, seq, k[layer, :, t], v[layer, :, t], q[layer, :, t])
            ref = exact_attention(q[layer, :, t], k16[layer, :, :t + 1], v16[layer, :, :t + 1], D ** -0.5)
            assert out.shape == (H, D) and out.dtype == np.float32
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert seq.length(0) == T
    kc, vc = eng.read_cache(seq, 1)
    np.testing.assert_array_equal(kc, k16[1])
    np.testing.assert_array_equal(vc, v16[1])
    m = eng.stats()
    assert m.tokens["body_high"] + m.tokens["residual"] + m.tokens["sink"] > 0 and m.compression_ratio > 0


def test_quantized_scheme_loses_and_accounts():
    s = kvq.load_scheme(spec("kivi2"))
    eng = kvq.Engine(s, L, H, HKV, D, backend="reference")
    seq = eng.sequence()
    T = 256
    k, v, q = rand(L, HKV, T, D, seed=4), rand(L, HKV, T, D, seed=5), rand(L, H, T, D, seed=6)
    for layer in range(L):
        eng.prefill(layer, seq, k[layer], v[layer], q[layer])
    kc, _ = eng.read_cache(seq, 0)
    err = np.linalg.norm(kc - k[0]) / np.linalg.norm(k[0])
    assert 0.05 < err < 1.0  # 2-bit keys lose, but keep the signal
    acc = s.account(L, H, HKV, D, batch=1, seq=T)
    assert acc.device_bytes == eng.stats().device_bytes
    assert acc.effective_bits < 16


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    eng = kvq.Engine(spec("fp16"), L, H, HKV, D, backend="reference", dtype=torch.float16)
    seq = eng.sequence()
    k = torch.randn(HKV, 8, D, dtype=torch.float16)
    eng.prefill(0, seq, k, k.float())  # another dtype is converted
    out = eng.decode(0, seq, k[:, 0], k[:, 0], torch.randn(H, D))
    assert out.shape == (H, D)


def test_calibration_decides_layer_modes(tmp_path):
    s = kvq.load_scheme(spec("tailorkv1"))
    eng = kvq.Engine(s, L, H, HKV, D, backend="reference")
    assert eng.layer_state(0) == "undecided"
    scores = []
    for layer in range(L):
        scores.append(eng.calibrate_layer(layer, rand(HKV, 128, D, seed=layer), rand(H, 128, D, seed=10 + layer)))
        assert eng.layer_state(layer) in ("quantized", "sparse")
    assert all(np.isfinite(scores))
    out = tmp_path / "map.kvq"
    eng.write_layer_map(str(out), "decided")
    decided = kvq.Spec.from_file(str(out)).scheme("decided")
    assert decided.name == "decided"
