"""kvq from Python: the C library (libkvq.so) through ctypes, a transformers cache (kvq.hf), and the kvq-dump and
kvq-ppl tools. docs/python.md is the guide."""
from .core import (BACKENDS, Diagnostic, Engine, MemStats, Scheme, Sequence, Spec, data_dir, library_path,
                   load_scheme, load_spec, spec_names, spec_path, specs_dir, version)
from .errors import (KvqError, KvqFormatError, KvqInternalError, KvqInvalidError, KvqIOError, KvqNoMemoryError,
                     KvqShapeError, KvqSpecError, KvqStateError, KvqUnavailableError, KvqUnsupportedError)

__version__ = "0.1.0"
