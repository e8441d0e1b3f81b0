"""kvq-dump: run a causal LM (a transformers folder or a GGUF file) on a text file and write its post-RoPE K, V and
Q as .npy in kvq eval's format (K, V [layers, kv_heads, tokens, head_dim], Q [layers, heads, tokens, head_dim]), for

    kvq eval specs/kivi2.kvq --keys DIR/K.npy --values DIR/V.npy --queries DIR/Q.npy"""
import argparse
import os
import sys

import numpy as np

from .models import add_arguments, from_args


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvq-dump", description=__doc__.split("\n\n")[0],
                                 epilog="Needs torch and transformers (pip install './python[hf]'); a GGUF file needs gguf "
                                        "and accelerate too (both in it).")
    add_arguments(ap)
    ap.add_argument("--out-dir", required=True, help="writes K.npy, V.npy, Q.npy here")
    ap.add_argument("--save-dtype", choices=["float32", "float16"], default="float32", help="the .npy element type")
    a = ap.parse_args(argv)
    _, model, ids = from_args(ap, a, "kvq-dump")
    from .capture import capture_qkv
    K, V, Q, _ = capture_qkv(model, ids)
    os.makedirs(a.out_dir, exist_ok=True)
    for name, x in (("K", K), ("V", V), ("Q", Q)):
        np.save(os.path.join(a.out_dir, name + ".npy"), x.astype(a.save_dtype))
    print("kvq-dump: %d tokens, %d layers, %d heads, %d kv heads, head_dim %d -> %s/{K,V,Q}.npy" % (
        K.shape[2], K.shape[0], Q.shape[1], K.shape[1], K.shape[3], a.out_dir), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
