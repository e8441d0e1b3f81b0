"""Bundles the checkout's libkvq.so into the package when it has been built (`make` in the checkout), so that
`pip install python/` works without KVQ_LIBRARY; without it the package looks for an installed libkvq at import
(kvq/_lib.py). Everything else is in pyproject.toml."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithLib(build_py):
    def run(self):
        super().run()
        built = os.path.join(HERE, "..", "build", "libkvq.so.0")
        if os.path.exists(built):
            dst = os.path.join(self.build_lib, "kvq", "libkvq.so.0")
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(os.path.realpath(built), dst)


setup(cmdclass={"build_py": BuildPyWithLib})
