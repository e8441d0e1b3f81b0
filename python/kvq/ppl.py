"""kvq-ppl: perplexity of a causal LM on a text under each kvq scheme, with the model's own attention as the
baseline, as one table.

Protocol (as KIVI's long-context evaluation): the first --prefill tokens are the prompt (attended exactly, then
stored in the scheme's cache); every later token is decoded against the compressed cache, and perplexity is
measured over those decoded tokens only, for the baseline too. Every scheme that can run is measured; one that
cannot (a spec with errors, a scheme the model's dims refuse, a run that fails) is a row with the reason, and
the table is printed whatever happens, also after Ctrl-C. Progress goes to stderr."""
import argparse
import math
import sys
import time
from dataclasses import dataclass

from .models import add_arguments, from_args

DECODE_CHUNK = 32  # tokens per forward of the decoded part: progress between them; causal, so the result is the same


@dataclass
class Row:
    name: str
    ppl: float = None
    bits: float = None        # device effective bits (MemStats.effective_bits)
    bits_host: float = None   # with host memory (TailorKV's offloaded prompt)
    note: str = ""            # why there is no perplexity


class Progress:
    """One line on stderr: rewritten in place on a terminal, else printed at most every 10 s (as kvq eval)."""

    def __init__(self, stream=None):
        stream = stream or sys.stderr
        self.stream, self.tty, self.last, self.shown = stream, stream.isatty(), 0.0, False

    def update(self, text, force=False):
        now = time.time()
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.shown = True
        elif force or now - self.last >= 10:
            self.stream.write(text + "\n")
            self.last = now
        self.stream.flush()

    def line(self, text):
        """A line that stays (a scheme's result)."""
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.shown = False
        self.stream.write(text + "\n")
        self.stream.flush()
        self.last = time.time()


def nll_of(logits, ids, start):
    """Mean negative log-likelihood of ids[start:] given logits [T, vocab] (position t predicts t + 1)."""
    import torch
    lp = torch.log_softmax(logits[start - 1:-1].float(), dim=-1)
    tgt = ids[start:]
    return float(-lp.gather(1, tgt[:, None]).mean())


def scheme_logits(model, ids, scheme, prefill, backend=None, report=None):
    """Logits [T, vocab] with the prompt prefilled into a KvqCache and the rest decoded through it; the cache."""
    import torch

    from .hf import KvqCache, cache_kwarg
    cache = KvqCache(scheme, model, backend=backend)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    T = ids.shape[1]
    parts = []
    with torch.no_grad():
        parts.append(model(input_ids=ids[:, :prefill], **kw).logits)
        for start in range(prefill, T, DECODE_CHUNK):
            end = min(start + DECODE_CHUNK, T)
            parts.append(model(input_ids=ids[:, start:end], **kw).logits)
            if report:
                report(end - prefill, T - prefill)
    return torch.cat(parts, dim=1)[0], cache


def baseline_logits(model, ids):
    import torch
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(before)


def _dims(model):
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    return (cfg.num_hidden_layers, heads, getattr(cfg, "num_key_value_heads", None) or heads,
            getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)


def plan(model, specs, progress=None):
    """[(Row, scheme or None)] for every scheme of every spec argument, in order: a spec that does not load, or a
    scheme the model's dims refuse (kvq_scheme_check_dims), is a Row with its note and no scheme to run. A scheme
    name seen before (a spec that includes another) is measured once."""
    import kvq
    dims = _dims(model)
    out, seen = [], set()
    for arg in specs:
        try:
            spec = kvq.load_spec(arg)
        except kvq.KvqError as e:
            out.append((Row(arg, note="spec not loaded: %s" % e), None))
            continue
        for sch in spec.schemes:
            if sch.name in seen:
                if progress:
                    progress.line("kvq-ppl: note: %s: scheme %s is measured once (an earlier spec has it)" % (
                        arg, sch.name))
                continue
            seen.add(sch.name)
            try:
                sch.check_dims(*dims)
            except kvq.KvqError as e:
                msg, prefix = str(e), "kvq: scheme '%s' " % sch.name
                out.append((Row(sch.name, note="refused: %s" % (msg[len(prefix):] if msg.startswith(prefix)
                                                                 else msg)), None))
                continue
            out.append((Row(sch.name), sch))
    return out


def measure(model, ids, specs, prefill, backend=None, progress=None):
    """[Row]: the baseline first, then every scheme of every spec (refused and failed ones with their note).
    KeyboardInterrupt ends the measuring; the rows not measured then say so."""
    import kvq
    rows = []
    todo = plan(model, specs, progress)
    try:
        t0 = time.time()
        rows.append(Row("baseline (model attention)"))
        try:
            rows[0].ppl = math.exp(nll_of(baseline_logits(model, ids), ids[0], prefill))
        except Exception as e:  # noqa: BLE001 (the schemes are still measured; the row says why)
            rows[0].note = "failed: %s: %s" % (type(e).__name__, e)
        if progress:
            progress.line("kvq-ppl: baseline: %s (%.1f s)" % (
                rows[0].note or "perplexity %.4f" % rows[0].ppl, time.time() - t0))
        runnable = sum(1 for _, s in todo if s is not None)
        i = 0
        for row, sch in todo:
            rows.append(row)
            if sch is None:
                if progress:
                    progress.line("kvq-ppl: %s: %s" % (row.name, row.note))
                continue
            i += 1
            t0 = time.time()

            def report(done, total, _i=i, _name=row.name, _t0=t0):
                el = time.time() - _t0
                progress.update("kvq-ppl: [%d/%d] %s: decoded %d/%d tokens, %.0f s, about %.0f s left" % (
                    _i, runnable, _name, done, total, el, el / done * (total - done)))

            if progress:
                progress.update("kvq-ppl: [%d/%d] %s: prefill of %d tokens" % (i, runnable, row.name, prefill),
                                force=True)
            try:
                logits, cache = scheme_logits(model, ids, sch, prefill, backend, report if progress else None)
                m = cache.stats()
                row.ppl = math.exp(nll_of(logits, ids[0], prefill))
                row.bits, row.bits_host = m.effective_bits, m.effective_bits_with_host
            except kvq.KvqError as e:
                row.note = "failed: %s" % e
            except Exception as e:  # noqa: BLE001 (one scheme's failure must not lose the other rows)
                row.note = "failed: %s: %s" % (type(e).__name__, e)
            if progress:
                progress.line("kvq-ppl: [%d/%d] %s: %s (%.1f s)" % (
                    i, runnable, row.name, row.note or "perplexity %.4f, %.2f effective bits" % (row.ppl, row.bits),
                    time.time() - t0))
    except KeyboardInterrupt:
        if rows and rows[-1].ppl is None and not rows[-1].note:
            rows[-1].note = "interrupted"
        done = {id(r) for r in rows}
        rows += [r for r, _ in todo if id(r) not in done]
        for r in rows:
            if r.ppl is None and not r.note:
                r.note = "not run (interrupted)"
        if not rows:
            rows.insert(0, Row("baseline (model attention)", note="interrupted"))
        raise Interrupted(rows)
    return rows


class Interrupted(Exception):
    def __init__(self, rows):
        super().__init__("interrupted")
        self.rows = rows


def format_table(rows, T, prefill, src):
    """The table as text; vs base is against the baseline row (when it was measured)."""
    base = rows[0].ppl if rows and rows[0].name.startswith("baseline") else None
    w = max([len(r.name) for r in rows] + [6])
    out = ["kvq-ppl: %s, %d tokens (prefill %d, perplexity over the %d decoded)" % (src, T, prefill, T - prefill),
           "%-*s %10s %10s %12s %9s  %s" % (w, "scheme", "eff. bits", "with host", "perplexity", "vs base", "note")]
    for r in rows:
        vs = "%+8.2f%%" % (100.0 * (r.ppl / base - 1.0)) if r.ppl is not None and base else "-"
        out.append(("%-*s %10s %10s %12s %9s  %s" % (
            w, r.name, "%.2f" % r.bits if r.bits is not None else "-",
            "%.2f" % r.bits_host if r.bits_host is not None else "-",
            "%.4f" % r.ppl if r.ppl is not None else "-", vs, r.note)).rstrip())
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="kvq-ppl", description=__doc__.split("\n\n")[0],
        epilog="Effective bits: device bits per stored K/V element, everything the cache allocates counted (fp16 "
               "windows too: short texts are dominated by them); 'with host' adds host memory (TailorKV keeps the "
               "prompt there). Exit status 1 when a row has no perplexity. Needs torch and transformers "
               "(pip install './python[hf]'); a GGUF file needs gguf and accelerate too (both in it).")
    ap.add_argument("specs", nargs="+", help=".kvq files, or names of the specs the package ships (kivi2, ott, ...); "
                    "every scheme in each is measured")
    add_arguments(ap)
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens (default: half)")
    ap.add_argument("--backend", default=None, help="kvq backend (default: cpu when available, else reference)")
    ap.add_argument("--quiet", action="store_true", help="no progress on stderr")
    a = ap.parse_args(argv)
    src, model, ids = from_args(ap, a, "kvq-ppl")
    T = ids.shape[1]
    prefill = a.prefill or T // 2
    if not 1 <= prefill < T:
        ap.error("--prefill %d: the text holds %d tokens" % (prefill, T))
    progress = None if a.quiet else Progress()
    status = 0
    try:
        rows = measure(model, ids, a.specs, prefill, a.backend, progress)
    except Interrupted as e:
        rows, status = e.rows, 130
    print(format_table(rows, T, prefill, src))
    sys.stdout.flush()
    if status == 0 and any(r.ppl is None for r in rows):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
