"""gpurt: NCCL-class collectives for Python on NumPy (and soon CuPy/PyTorch GPU) arrays,
moved by pluggable transports, with MPI (mpi4py) as the control plane.

    import gpurt
    comm = gpurt.init()
    y = comm.allreduce(x)            # in place, op=gpurt.SUM
"""

from __future__ import annotations

import logging as _logging

from . import config
from ._version import __version__
from .comm import Communicator, init
from .errors import (CollectiveMismatchError, CollectiveTimeout, CommunicatorClosed, GpurtError,
                     PeerFailure, ResourceError, TransportError)
from .executor import Request
from .ops import AVG, BAND, BOR, BXOR, MAX, MIN, PROD, SUM, Op
from .sharedmem import empty, is_shared, zeros

__all__ = [
    "__version__", "init", "Communicator", "Request", "Op", "empty", "zeros", "is_shared",
    "SUM", "PROD", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR",
    "GpurtError", "CollectiveTimeout", "PeerFailure", "CollectiveMismatchError",
    "TransportError", "ResourceError", "CommunicatorClosed",
]

try:
    _logging.getLogger("gpurt").setLevel(config.get("GPURT_LOG"))
except ValueError as _e:   # (import works; creating a communicator raises it on every rank)
    import warnings as _warnings
    _warnings.warn(str(_e), stacklevel=2)
