"""A virtual cluster for tests and benchmarks: network-namespace "nodes" with their own
host names, private /dev/shm and PID namespaces, joined by a (shaped) bridge, with real
MPICH hydra ``mpiexec`` across them.  See :mod:`tests.cluster.vcluster`.

The names below are imported lazily, so that ``python -m tests.cluster.vcluster`` does not
import the module twice.
"""

__all__ = ["MPICH_TCP_ENV", "ClusterError", "Traffic", "VirtualCluster", "available",
           "hydra_mpiexec", "reap_stale"]


def __getattr__(name: str):
    if name in __all__:
        from . import vcluster
        return getattr(vcluster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
