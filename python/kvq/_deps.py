"""The optional packages of kvq's model tools, and the one-line message that names the extra to install when one
is missing. The C API (kvq.Engine, ...) needs numpy only; kvq.hf, kvq-dump and kvq-ppl need torch and
transformers, and a GGUF checkpoint needs gguf and accelerate (transformers loads one with both): the extra 'hf',
`pip install './python[hf]'` from a checkout."""
import importlib.util

HF_MISSING = ("pip install './python[hf]' in the kvq checkout (the extra 'hf': torch, transformers, gguf, "
              "accelerate), or pip install torch transformers")


def missing(*modules):
    """The modules of `modules` that cannot be imported here (not installed, or blocked: sys.modules[m] = None)."""
    out = []
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):
            out.append(m)
    return out


def require_hf(what, exc=SystemExit):
    """Raises exc with one line naming what to install when torch or transformers is missing."""
    gone = missing("torch", "transformers")
    if gone:
        raise exc("%s: needs %s, which %s not installed: %s" % (what, " and ".join(gone),
                                                               "is" if len(gone) == 1 else "are", HF_MISSING))


def require_gguf(what, exc=SystemExit):
    """A GGUF checkpoint: transformers reads it with the gguf package and loads it with accelerate."""
    gone = missing("gguf", "accelerate")
    if gone:
        raise exc("%s: reading a GGUF file needs %s, which %s not installed: pip install %s (both are in the extra "
                  "'hf': pip install './python[hf]')" % (what, " and ".join(gone), "is" if len(gone) == 1 else "are",
                                                          " ".join(gone)))
