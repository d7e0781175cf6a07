"""The virtual cluster lives in the product (``gpurt.launch.vcluster``: ``gpurt launch
--simulate`` uses it); tests and benchmarks import it from here."""

from gpurt.launch.vcluster import *  # noqa: F401,F403
from gpurt.launch.vcluster import (MPICH_TCP_ENV, ClusterError, Traffic,  # noqa: F401
                                   VirtualCluster, available, hydra_mpiexec, main,
                                   reap_stale)

if __name__ == "__main__":
    import sys
    sys.exit(main())
