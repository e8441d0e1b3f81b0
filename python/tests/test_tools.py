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


def test_ppl_table(tiny_llama_dir, text_file):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-m", "kvq.ppl", spec("fp16"), spec("kivi2"), "--model", tiny_llama_dir,
                        "--text", text_file, "--byte-tokens", "--prefill", "200"], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr
    rows = {l.split()[0]: l.split() for l in r.stdout.splitlines()[2:]}
    base = float(rows["baseline"][-2])
    assert float(rows["fp16"][-2]) == pytest.approx(base, rel=1e-3)
    assert float(rows["kivi2"][-3]) < 16
    assert np.isfinite(float(rows["kivi2"][-2]))


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
