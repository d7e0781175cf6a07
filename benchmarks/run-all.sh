#!/usr/bin/env bash
# The measurements behind docs/performance.md (about 10 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${GPURT:-gpurt}
out=benchmarks/out
mkdir -p "$out"
$B bench allreduce -n 2 -b 4 -e 64M -f 4 --baseline mpi --repeat 2 \
    --json "$out/allreduce2.json" --plot "$out/allreduce2.png" | tee "$out/allreduce2.txt"
$B bench allreduce -n 4 -b 4 -e 64M -f 4 --baseline mpi --repeat 2 \
    --json "$out/allreduce4.json" | tee "$out/allreduce4.txt"
for c in allgather reduce_scatter broadcast alltoall; do
  for n in 2 4; do
    for mem in host shared; do      # shared: gpurt on comm.empty arrays, MPI on NumPy's
      $B bench "$c" -n "$n" -b 16M -e 16M --baseline mpi --repeat 2 -i 20 --memory "$mem" \
          | tee "$out/$c$n-$mem.txt"
    done
  done
done
$B bench allreduce -n 2 -b 8 -e 256M -f 32 --baseline gloo | tee "$out/gloo2.txt"
$B bench allreduce -n 2 -b 16M -e 256M -f 4 -c | tee "$out/ceiling2.txt"
$B bench allreduce -n 2 -b 1M -e 256M -f 4 --baseline mpi --repeat 2 -i 10 -c --memory shared \
    | tee "$out/ceiling2-shared.txt"
$B bench allreduce -n 4 -b 256K -e 64M -f 4 --baseline mpi --repeat 2 --memory shared \
    | tee "$out/allreduce4-shared.txt"
# shm_direct against the tuner's schedules, alternating in one launch (its thresholds)
for n in 2 4; do
  for c in allreduce reduce reduce_scatter allgather alltoall broadcast; do
    mpiexec -n "$n" python benchmarks/direct_ab.py "$c" 1M,4M,16M shared,numpy \
        | tee "$out/direct-$c$n.txt"
  done
done
# several simulated nodes on this machine (MPICH cliques: tcp between them): what the
# agreement check costs, and the blocking allreduce's inline path against the general one
for n in 2 4; do
  MPIR_CVAR_NUM_CLIQUES=2 $B bench allreduce -n "$n" -b 4K -e 1M -f 16 -i $((800 / n)) \
      --baseline nocheck --repeat 3 | tee "$out/nocheck-2x$((n / 2)).txt"
  for c in allreduce broadcast barrier reduce allgather reduce_scatter alltoall gather; do
    MPIR_CVAR_NUM_CLIQUES=2 mpiexec -n "$n" python benchmarks/inline_ab.py "$c" 8,4K,64K,1M \
        | tee "$out/inline-$c-2x$((n / 2)).txt"
  done
done
# several nodes (root only: a virtual cluster of network namespaces)
if [ "$(id -u)" = 0 ]; then
  python benchmarks/multinode.py --nodes 2 --ppn 2 --rate 1gbit --bytes 64M --iters 5 \
      --rounds 3 --json "$out/multinode-2x2.json" | tee "$out/multinode-2x2.txt"
  python benchmarks/multinode.py --nodes 3 --ppn 2 --rate 1gbit --bytes 64M --iters 3 \
      --rounds 1 --json "$out/multinode-3x2.json" | tee "$out/multinode-3x2.txt"
fi
