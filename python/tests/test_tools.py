"""kvq-dump, kvq-ppl and kvq eval on the dumped tensors."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import ROOT, spec  # noqa: E402
from kvq.evaluate import evaluate  # noqa: E402

TEXT = ("kvq compresses the key value cache of a transformer. " * 12).encode()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_bytes(TEXT[:320])
    return str(p)


@pytest.fixture(scope="module")
def dump(tiny_llama_dir, text_file, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dump"))
    from kvq.dump import main
    assert main(["--model", tiny_llama_dir, "--text", text_file, "--out-dir", out, "--byte-tokens"]) == 0
    return out


def test_dump_layout(dump):
    K, V, Q = (np.load(os.path.join(dump, n + ".npy")) for n in "KVQ")
    assert K.shape == (2, 2, 320, 64) and V.shape == K.shape and Q.shape == (2, 4, 320, 64)
    assert K.dtype == np.float32


def parse_eval(out):
    """{scheme: {row: value}} from kvq eval's table."""
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if l.startswith("kvq eval:"))
    names = lines[head + 1].split()
    rows = {}
    for l in lines[head + 2:]:
        m = re.match(r"^(\S.*?)\s{2,}(.*)$", l)
        if m:
            rows[m.group(1).strip()] = [float(x) for x in m.group(2).split()]
    return {n: {r: v[i] for r, v in rows.items()} for i, n in enumerate(names)}


def test_dump_through_kvq_eval_matches_python(dump, kvq_tool):
    files = [os.path.join(dump, n + ".npy") for n in "KVQ"]
    r = subprocess.run([kvq_tool, "eval", spec("kivi2"), spec("kivi4"), "--backend", "reference", "--keys", files[0],
                        "--values", files[1], "--queries", files[2], "--prefill", "200"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    table = parse_eval(r.stdout)
    K, V, Q = (np.load(f) for f in files)
    for name in ("kivi2", "kivi4"):
        py = evaluate(spec(name), K, V, Q, prefill=200, backend="reference")
        assert table[name]["attn rel err"] == pytest.approx(py["attn_rel_err"], rel=1e-4, abs=2e-6)
        assert table[name]["key rel err"] == pytest.approx(py["key_rel_err"], rel=1e-4, abs=2e-6)
        assert table[name]["value rel err"] == pytest.approx(py["value_rel_err"], rel=1e-4, abs=2e-6)
        assert table[name]["effective bits"] == pytest.approx(py["effective_bits"], abs=1e-5)
    assert table["kivi2"]["attn rel err"] > table["kivi4"]["attn rel err"] > 0


def run_ppl(*args):
    """kvq-ppl's main in this process (no second torch import): (status, stdout, stderr)."""
    import contextlib
    import io
    from types import SimpleNamespace

    from kvq.ppl import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
            err.write(str(e.code))
    return SimpleNamespace(returncode=rc, stdout=out.getvalue(), stderr=err.getvalue())


def ppl_rows(out):
    """{name: (effective bits, with host, perplexity, vs base, note)} from kvq-ppl's table (None for '-')."""
    lines = out.splitlines()
    assert lines[0].startswith("kvq-ppl: ") and lines[1].split()[:2] == ["scheme", "eff."], out
    rows = {}
    for line in lines[2:]:
        num = r"\s+(-|[-+]?[0-9.]+%?)"
        m = re.match(r"^(.+?)" + num * 4 + r"(?:  (.*))?$", line)
        assert m, "not a row: %r" % line
        num = [None if x == "-" else float(x.rstrip("%")) for x in m.groups()[1:5]]
        rows[m.group(1).strip()] = tuple(num) + (m.group(6) or "",)
    return rows


@pytest.fixture(scope="module")
def folder_ppl(tiny_llama_dir, text_file):
    r = run_ppl(spec("fp16"), spec("kivi2"), "--model", tiny_llama_dir, "--text", text_file, "--byte-tokens",
                "--prefill", "200")
    assert r.returncode == 0, r.stderr
    return r


def test_ppl_table(folder_ppl):
    rows = ppl_rows(folder_ppl.stdout)
    assert list(rows) == ["baseline (model attention)", "fp16", "kivi2"]
    base = rows["baseline (model attention)"][2]
    assert rows["fp16"][2] == pytest.approx(base, rel=1e-3)
    assert rows["kivi2"][0] < 16 and rows["kivi2"][1] == rows["kivi2"][0]  # no host memory
    assert np.isfinite(rows["kivi2"][2])
    # Progress on stderr: the baseline and each scheme's result.
    assert "kvq-ppl: baseline: perplexity" in folder_ppl.stderr
    assert re.search(r"kvq-ppl: \[2/2\] kivi2: perplexity [0-9.]+, [0-9.]+ effective bits", folder_ppl.stderr)


def test_ppl_rows_survive_failures_and_ctrl_c(tiny_llama, monkeypatch):
    """A scheme whose run raises is a 'failed' row and the next one runs; Ctrl-C ends the measuring with every row
    accounted for (the one running 'interrupted', the rest 'not run'), so main can still print the table."""
    import torch

    import kvq.ppl as ppl
    from conftest import fresh_copy
    real = ppl.scheme_logits

    def flaky(model, ids, scheme, *args, **kwargs):
        if scheme.name == "kivi4":
            raise RuntimeError("boom")
        if scheme.name == "kivi2":
            raise KeyboardInterrupt
        return real(model, ids, scheme, *args, **kwargs)

    monkeypatch.setattr(ppl, "scheme_logits", flaky)
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(8))
    with pytest.raises(ppl.Interrupted) as e:
        ppl.measure(fresh_copy(tiny_llama), ids, ["fp16", "kivi4", "ott", "kivi2", "zipcache"], 40)
    rows = {r.name: r for r in e.value.rows}
    assert list(rows) == ["baseline (model attention)", "fp16", "kivi4", "ott", "kivi2", "zipcache"]
    assert rows["baseline (model attention)"].ppl > 0 and rows["fp16"].ppl > 0
    assert rows["kivi4"].ppl is None and rows["kivi4"].note == "failed: RuntimeError: boom"
    assert rows["ott"].note.startswith("refused: ") and "head_dim 64" in rows["ott"].note
    assert rows["kivi2"].note == "interrupted" and rows["zipcache"].note == "not run (interrupted)"
    table = ppl.format_table(e.value.rows, 80, 40, "model").splitlines()
    assert len(table) == 2 + len(rows) and table[-1].split()[0] == "zipcache" and table[-1].endswith("(interrupted)")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from gguf_model import write_llama_gguf
    return write_llama_gguf(tiny_llama, str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"))


def test_ppl_on_gguf_with_a_refused_spec(tiny_gguf, folder_ppl, text_file):
    """kvq-ppl on a GGUF file (written by the gguf package's writer, with its byte-level tokenizer): every spec
    is a row; OTT, whose value groups of 128 channels cannot split head_dim 64, is a row with that reason, and
    the rest are measured. The GGUF model is the folder model's weights and its tokenizer gives the bytes, so its
    perplexities equal the folder run's."""
    r = run_ppl(spec("fp16"), "kivi2", spec("ott"), "--gguf", tiny_gguf, "--text", text_file, "--prefill", "200")
    assert r.returncode == 1, r.stderr  # a row without perplexity
    assert "Traceback" not in r.stderr, r.stderr
    rows = ppl_rows(r.stdout)
    assert list(rows) == ["baseline (model attention)", "fp16", "kivi2", "ott"], r.stdout
    assert rows["ott"][:4] == (None, None, None, None)
    assert "refused" in rows["ott"][4] and "value group 128 does not divide head_dim 64" in rows["ott"][4]
    want = ppl_rows(folder_ppl.stdout)
    for name in ("baseline (model attention)", "fp16", "kivi2"):
        assert rows[name][2] == pytest.approx(want[name][2], rel=1e-4), (name, r.stdout, folder_ppl.stdout)
    assert rows["kivi2"][0] == pytest.approx(want["kivi2"][0])
    assert "ott: refused" in r.stderr
    # --model FILE finds the same file (by its .gguf suffix).
    r2 = run_ppl("fp16", "--model", tiny_gguf, "--text", text_file, "--prefill", "200", "--quiet")
    assert r2.returncode == 0, r2.stderr
    assert ppl_rows(r2.stdout)["fp16"][2] == pytest.approx(rows["fp16"][2], rel=1e-6)


def test_dump_gguf(tiny_gguf, dump, text_file, tmp_path):
    """kvq-dump --model on a GGUF file without the .gguf suffix (found by its magic bytes): the same K, V, Q as
    the folder model's."""
    plain = tmp_path / "tiny-llama.bin"
    os.symlink(tiny_gguf, plain)
    from kvq.dump import main
    out = str(tmp_path / "kv")
    assert main(["--model", str(plain), "--text", text_file, "--out-dir", out]) == 0
    for n in "KVQ":
        np.testing.assert_allclose(np.load(os.path.join(out, n + ".npy")), np.load(os.path.join(dump, n + ".npy")),
                                   rtol=1e-5, atol=1e-5)


def test_tools_without_torch(tiny_llama_dir, text_file):
    """--help needs nothing; without torch or transformers the tools name the extra to install, in one line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    block = "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
    for tool in ("ppl", "dump"):
        h = subprocess.run([sys.executable, "-c", block + "from kvq.%s import main; sys.exit(main(['--help']))" % tool],
                           capture_output=True, text=True, env=env)
        assert h.returncode == 0 and "--gguf" in h.stdout, h.stderr
        args = "['kivi2', '--model', %r, '--text', %r]" % (tiny_llama_dir, text_file) if tool == "ppl" else \
            "['--model', %r, '--text', %r, '--out-dir', 'x']" % (tiny_llama_dir, text_file)
        r = subprocess.run([sys.executable, "-c", block + "from kvq.%s import main; sys.exit(main(%s))" % (tool, args)],
                           capture_output=True, text=True, env=env)
        assert r.returncode == 1, r
        assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
        assert "kvq-%s: needs torch and transformers" % tool in r.stderr and "./python[hf]" in r.stderr, r.stderr


def test_eval_small_errors_are_not_zero(kvq_tool, tmp_path):
    """kvq eval prints an error below 1e-3 with significant digits: the printed attention error of specs/fp16.kvq
    on the default backend (cpu where it runs: fp32 arithmetic leaves ~1e-7) is the one recomputed here from
    --out-dir's attention outputs, and 0.000000 only when that is exactly 0 (the reference backend)."""
    from kvq.evaluate import exact_attention
    rng = np.random.default_rng(3)
    HKV, H, T, D, N = 2, 4, 40, 64, 24
    k, v = (rng.standard_normal((1, HKV, T, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, H, T, D)).astype(np.float32)
    files = []
    for name, x in (("K", k), ("V", v), ("Q", q)):
        files.append(str(tmp_path / (name + ".npy")))
        np.save(files[-1], x)
    r = subprocess.run([kvq_tool, "eval", spec("fp16"), "--keys", files[0], "--values", files[1], "--queries",
                        files[2], "--prefill", str(N), "--out-dir", str(tmp_path / "out")], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    cell = next(l for l in r.stdout.splitlines() if l.startswith("attn rel err")).split()[-1]
    out = np.load(str(tmp_path / "out" / "fp16" / "attn.npy"))[0].astype(np.float64)  # [heads, steps, head_dim]
    k16, v16 = k[0].astype(np.float16).astype(np.float32), v[0].astype(np.float16).astype(np.float32)
    num = den = 0.0
    for step, t in enumerate(range(N, T)):
        ref = exact_attention(q[0, :, t], k16[:, :t + 1], v16[:, :t + 1], D ** -0.5)
        num += ((out[:, step] - ref) ** 2).sum()
        den += (ref ** 2).sum()
    err = float(np.sqrt(num / den))
    if err == 0:
        assert cell == "0.000000", r.stdout
    else:
        assert cell != "0.000000" and float(cell) == pytest.approx(err, rel=0.02), (cell, err, r.stdout)


def test_eval_plot_and_model_dims(kvq_tool, tmp_path):
    pytest.importorskip("matplotlib")
    s = tmp_path / "m.kvq"
    s.write_text("scheme m4 {\n  model { layers 2; heads 8; kv_heads 2; head_dim 64; }\n  bits 4;\n}\n")
    png = tmp_path / "out.png"
    env = dict(os.environ, KVQ_PYTHON=sys.executable)
    r = subprocess.run([kvq_tool, "eval", str(s), spec("kivi4"), "--backend", "reference", "--synthetic", "--tokens",
                        "48", "--plot", str(png)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "2 layers, 8 heads, 2 kv heads, head_dim 64" in r.stdout  # the spec's model block
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import json
    data = json.loads((tmp_path / "out.png.json").read_text())
    assert [x["name"] for x in data["schemes"]] == ["m4", "kivi4"] and len(data["schemes"][0]["attn_layer_rel_err"]) == 2
    assert "fp16 windows" in r.stderr  # 48 tokens: KIVI's residual window is the whole cache
