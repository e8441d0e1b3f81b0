"""`pip install ./python` from a kvq checkout: bundles the checkout's libkvq.so into the package, building it first
(`make lib`) when the checkout has never been built, and ships the checkout's specs/ as kvq/specs (the paper
specs, found by name: KvqCache("kivi2", model)). With KVQ_LIBRARY set, nothing is built or bundled: the package
loads that library. Outside a checkout the package looks for an installed libkvq at import (kvq/_lib.py).
Everything else is in pyproject.toml."""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _make_lib():
    """Runs `make lib` in the checkout; returns None, or what went wrong and what to run instead."""
    cmd = ["make", "-C", ROOT, "lib"]
    print("kvq: %s/build/libkvq.so.0 is not built: running %s (a first build takes a few minutes)" % (
        ROOT, " ".join(cmd)), file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    try:
        rc = subprocess.call(cmd, env=env, stdout=sys.stderr)
    except OSError as e:
        rc = "could not run make: %s" % e.strerror
    if rc == 0:
        return None
    why = rc if isinstance(rc, str) else "`%s` exited with status %d" % (" ".join(cmd), rc)
    return ("kvq: building libkvq failed (%s). Build it in the checkout with `make` (docs/install.md lists what it "
            "needs), then run `pip install ./python` again; or, with libkvq installed (`make install`), run pip "
            "with KVQ_LIBRARY set to it (e.g. KVQ_LIBRARY=/usr/local/lib/libkvq.so.0), also when using the "
            "package." % why)


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        if not os.path.isfile(os.path.join(ROOT, "runtime", "include", "kvq.h")):
            return  # not a checkout (an sdist): the library comes from the system
        specs = os.path.join(self.build_lib, "kvq", "specs")
        shutil.rmtree(specs, ignore_errors=True)
        shutil.copytree(os.path.join(ROOT, "specs"), specs, ignore=shutil.ignore_patterns("*~", ".*"))
        if os.environ.get("KVQ_LIBRARY"):
            return  # the package will load that library (kvq/_lib.py): nothing to bundle
        built = os.path.join(ROOT, "build", "libkvq.so.0")
        if not os.path.exists(built):
            err = _make_lib()
            if err or not os.path.exists(built):
                raise SystemExit(err or "kvq: `make lib` did not make %s" % built)
        dst = os.path.join(self.build_lib, "kvq", "libkvq.so.0")
        shutil.copy2(os.path.realpath(built), dst)


setup(cmdclass={"build_py": BuildPyWithLib})
