"""kvq-ppl: perplexity of a causal LM on a text under each kvq scheme, with the model's own fp16-or-better
attention as the baseline, as one table.

Protocol (as KIVI's long-context evaluation): the first --prefill tokens are the prompt (attended exactly, then
stored in the scheme's cache); every later token is decoded against the compressed cache, and perplexity is
measured over those decoded tokens only, for the baseline too."""
import argparse
import math
import sys

import torch


def nll_of(logits, ids, start):
    """Mean negative log-likelihood of ids[start:] given logits [T, vocab] (position t predicts t + 1)."""
    lp = torch.log_softmax(logits[start - 1:-1].float(), dim=-1)
    tgt = ids[start:]
    return float(-lp.gather(1, tgt[:, None]).mean())


def scheme_logits(model, ids, spec, prefill, backend=None):
    from .hf import KvqCache
    cache = KvqCache(spec, model, backend=backend)
    with torch.no_grad():
        a = model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits
        b = model(input_ids=ids[:, prefill:], past_key_values=cache, use_cache=True).logits
    return torch.cat([a, b], dim=1)[0], cache


def baseline_logits(model, ids):
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(before)


def perplexities(model, ids, specs, prefill, backend=None):
    """[(name, effective_bits or None, ppl)]: the baseline first, then every scheme of every spec."""
    import kvq
    base = baseline_logits(model, ids)
    rows = [("baseline (model attention)", None, math.exp(nll_of(base, ids[0], prefill)))]
    for path in specs:
        spec = kvq.Spec.from_file(path)
        for sch in spec.schemes:
            logits, cache = scheme_logits(model, ids, sch, prefill, backend)
            rows.append((sch.name, cache.stats().effective_bits, math.exp(nll_of(logits, ids[0], prefill))))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvq-ppl", description=__doc__.split("\n\n")[0])
    ap.add_argument("specs", nargs="+", help=".kvq files (every scheme in each is measured)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=None, help="at most this many tokens of the text")
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens (default: half)")
    ap.add_argument("--byte-tokens", action="store_true", help="token ids are the text's bytes (no tokenizer)")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    ap.add_argument("--backend", default=None, help="kvq backend (default: cpu when available, else reference)")
    a = ap.parse_args(argv)
    from .text import load_model, tokenize
    model = load_model(a.model, a.dtype)
    ids = tokenize(a.model, a.text, a.byte_tokens, a.tokens)
    T = ids.shape[1]
    prefill = a.prefill or T // 2
    if not 1 <= prefill < T:
        ap.error("--prefill %d: the text holds %d tokens" % (prefill, T))
    rows = perplexities(model, ids, a.specs, prefill, a.backend)
    base = rows[0][2]
    print("kvq-ppl: %d tokens (prefill %d, perplexity over the %d decoded)" % (T, prefill, T - prefill))
    w = max(len(r[0]) for r in rows)
    print("%-*s %14s %12s %10s" % (w, "scheme", "effective bits", "perplexity", "vs base"))
    for name, bits, ppl in rows:
        print("%-*s %14s %12.4f %+9.2f%%" % (w, name, "%.2f" % bits if bits is not None else "-", ppl,
                                             100.0 * (ppl / base - 1.0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
