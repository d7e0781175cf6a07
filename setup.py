"""The one compiled part: gpurt._fastboard, the shm board's inline small-message round.

Optional: where no C compiler is at hand the build goes on without it (with a warning)
and gpurt runs the same protocol in Python (``gpurt info`` says which one is in use).
``GPURT_NO_EXTENSION=1`` builds a pure-Python wheel (any CPython: tests/gpu/fetch_wheels.sh
uses it for a machine whose Python version is not known in advance).  Everything else is
declared in setup.cfg / pyproject.toml.
"""

import os

from setuptools import Extension, setup

EXT = [Extension("gpurt._fastboard", ["gpurt/_fastboard.c"], optional=True,
                 extra_compile_args=["-O3", "-fno-fast-math", "-ffp-contract=off",
                                     "-fno-strict-aliasing"])]

setup(ext_modules=[] if os.environ.get("GPURT_NO_EXTENSION") == "1" else EXT)
