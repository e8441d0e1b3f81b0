"""Where kvq-dump and kvq-ppl get a causal LM and its tokens: a transformers model folder (or hub name, where
reachable), or a GGUF file (llama.cpp's format), which transformers reads with `gguf_file=` (the gguf package
parses it; the weights are dequantized to the compute dtype). A file is taken as GGUF when its name ends in .gguf
or it starts with GGUF's magic bytes."""
import os
from dataclasses import dataclass

GGUF_MAGIC = b"GGUF"


class ModelSourceError(ValueError):
    """--model / --gguf name nothing loadable; the message says what was found instead."""


@dataclass(frozen=True)
class ModelSource:
    path: str              # a model folder (or hub name); for a GGUF file, the folder it is in
    gguf_file: str = None  # the GGUF file's name inside `path`, or None

    def kwargs(self):
        """The from_pretrained arguments past the path."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def __str__(self):
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else self.path


def _magic(path):
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as e:
        raise ModelSourceError("%s: %s" % (path, e.strerror)) from None


def _gguf_file(path, why):
    if _magic(path) != GGUF_MAGIC:
        raise ModelSourceError("%s: %s, but it does not start with GGUF's magic bytes: not a GGUF file" % (path, why))
    full = os.path.abspath(path)
    return ModelSource(os.path.dirname(full), os.path.basename(full))


def resolve(model=None, gguf=None):
    """The ModelSource of the tools' --model and --gguf. --gguf FILE alone: that GGUF file; --model DIR --gguf NAME:
    the GGUF file NAME inside DIR (transformers' gguf_file=); --model FILE: a GGUF file (by its .gguf suffix or
    its magic); --model DIR: a transformers folder (config.json and weights) or a hub name."""
    if gguf:
        if model:
            if os.path.isdir(model):
                return _gguf_file(os.path.join(model, gguf), "given as --gguf")
            return ModelSource(model, gguf)  # a hub name: transformers fetches the file, where reachable
        return _gguf_file(gguf, "given as --gguf")
    if not model:
        raise ModelSourceError("give --model (a model folder or a GGUF file) or --gguf FILE")
    if os.path.isfile(model):
        if model.lower().endswith(".gguf") or _magic(model) == GGUF_MAGIC:
            return _gguf_file(model, "named .gguf")
        raise ModelSourceError("%s is a file but not a GGUF file (no GGUF magic bytes): give a model folder (with "
                               "config.json) or a .gguf file" % model)
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        ggufs = sorted(f for f in os.listdir(model) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return _gguf_file(os.path.join(model, ggufs[0]), "the folder's only .gguf file")
        if ggufs:
            raise ModelSourceError("%s has no config.json but %d GGUF files (%s): name one with --gguf" % (
                model, len(ggufs), ", ".join(ggufs)))
        raise ModelSourceError("%s has neither config.json nor a .gguf file: not a model folder" % model)
    return ModelSource(model)


def load_model(src, dtype="float32"):
    import torch
    from transformers import AutoModelForCausalLM
    dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    return AutoModelForCausalLM.from_pretrained(src.path, dtype=dt, attn_implementation="sdpa", **src.kwargs()).eval()


def tokenize(src, text_file, byte_tokens=False, max_tokens=None):
    """ids [1, T]: the model's tokenizer (a GGUF file carries its own), or with byte_tokens the file's UTF-8 bytes
    as ids (for models without a tokenizer, e.g. a test model whose vocabulary holds 256 ids)."""
    import torch
    with open(text_file, "rb") as f:
        data = f.read()
    if byte_tokens:
        ids = list(data)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(src.path, **src.kwargs())
        ids = tok(data.decode("utf-8", errors="replace"))["input_ids"]
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ModelSourceError("%s holds fewer than 2 tokens" % text_file)
    return torch.tensor([ids], dtype=torch.long)


def add_arguments(ap):
    """The model and text options kvq-dump and kvq-ppl share."""
    ap.add_argument("--model", help="a transformers model folder (config.json and weights), a GGUF file, or a hub "
                    "name where the hub is reachable")
    ap.add_argument("--gguf", metavar="FILE", help="a GGUF file; with --model DIR, the name of one inside DIR")
    ap.add_argument("--text", required=True, help="the text file to run")
    ap.add_argument("--tokens", type=int, default=None, help="at most this many tokens of the text")
    ap.add_argument("--byte-tokens", action="store_true", help="token ids are the text's bytes (no tokenizer)")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="the model's compute type")


def from_args(ap, a, tool):
    """(ModelSource, model, ids [1, T]) for parsed options; a bad option or a missing package ends the program with
    one line (argparse's usage error, or `tool: ...` and status 1)."""
    import sys
    import time

    from ._deps import require_gguf, require_hf
    require_hf(tool)
    try:
        src = resolve(a.model, a.gguf)
    except ModelSourceError as e:
        ap.error(str(e))
    if src.gguf_file:
        require_gguf(tool)
    start = time.time()
    print("%s: loading %s%s" % (tool, src, " (GGUF: dequantized to %s)" % a.dtype if src.gguf_file else ""),
          file=sys.stderr)
    try:
        model = load_model(src, a.dtype)
    except Exception as e:  # transformers' many ways of refusing a folder or file: one line, not a traceback
        raise SystemExit("%s: cannot load a model from %s: %s: %s" % (tool, src, type(e).__name__,
                                                                      str(e).strip().splitlines()[0] if str(e) else ""))
    try:
        ids = tokenize(src, a.text, a.byte_tokens, a.tokens)
    except ModelSourceError as e:
        ap.error(str(e))
    except OSError as e:
        raise SystemExit("%s: %s: %s" % (tool, getattr(e, "filename", None) or a.text, e.strerror or e))
    except Exception as e:
        raise SystemExit("%s: cannot tokenize with %s's tokenizer (--byte-tokens uses the bytes): %s: %s" % (
            tool, src, type(e).__name__, str(e).strip().splitlines()[0] if str(e) else ""))
    print("%s: loaded in %.1f s: %s, %d layers; %d tokens of %s" % (
        tool, time.time() - start, type(model).__name__, model.config.get_text_config().num_hidden_layers,
        ids.shape[1], a.text), file=sys.stderr)
    return src, model, ids
