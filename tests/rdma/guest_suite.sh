#!/bin/bash
# Runs inside the Soft-RoCE guest(s) (tests/rdma/harness.py run(...), cwd = the project at
# /mnt/host, $GUEST_MPIEXEC = mpiexec over every guest): the verbs transport's real-device
# checks, one section after another.  Each section prints
#     === BEGIN name
#     ...its output...
#     === END name rc=N seconds=S
# and tests/test_verbs.py asserts on them.  A section that runs past $SECTION_TIMEOUT s
# (default 600) is stopped (SIGTERM to its whole process group, which reaches node1's ranks
# through the rsh; SIGKILL 20 s later) and ends with rc=124, so one hung section fails on its
# own, with its output, and the others still run.
#
#   guest_suite.sh one   # one guest: 2 and 3 ranks, every peer over verbs
#   guest_suite.sh two   # two guests = two nodes, 2 ranks each: verbs between, shm inside
#   guest_suite.sh newer # one guest of the trixie image (RXE_VM_SUITE=trixie): pyverbs 56.1
set -u
mode=${1:?one or two}
export PYTHONUNBUFFERED=1 GPURT_TIMEOUT=240
SECTION_TIMEOUT=${SECTION_TIMEOUT:-600}

section() {  # section NAME COMMAND...
    local name=$1; shift
    local t0=$SECONDS
    echo "=== BEGIN $name"
    # (a shell function runs in a child bash that has it: GNU timeout signals a process group)
    [ "$(type -t "$1")" = function ] && set -- bash -c '"$@"' section-fn "$@"
    timeout -k 20 "$SECTION_TIMEOUT" "$@" 2>&1
    local rc=$?
    [ $rc = 124 ] && echo "guest_suite: section $name did not end in $SECTION_TIMEOUT s: stopped"
    echo "=== END $name rc=$rc seconds=$((SECONDS - t0))"
}

failures() {  # failures CASE NRANKS: a rank fails mid-stream; every survivor reports
    local dir=/tmp/verbs-$1
    rm -rf "$dir"; mkdir -p "$dir"
    GPURT_PEER_STOPPED=3 GPURT_IB_TIMEOUT=14 $GUEST_MPIEXEC -disable-auto-cleanup -n "$2" \
        sh -c "trap true USR1; python3 tests/rdma/verbs_failures.py $1 $dir"
    echo "mpiexec rc=$?"
    cat "$dir"/rank[0-9]* 2>/dev/null
}
export -f failures

after() {  # after VAR COMMAND...: COMMAND with $VAR naming a file for its result lines,
    # printed once COMMAND (an mpiexec) has ended: over two guests, a remote rank's late
    # stderr lands inside a line rank 0 prints
    local var=$1 out=/tmp/result-$$.txt rc
    shift
    rm -f "$out"
    env "$var=$out" "$@"
    rc=$?
    echo "mpiexec rc=$rc"
    [ -s "$out" ] && { echo; cat "$out"; }
    rm -f "$out"
    return $rc
}

cases() {  # cases MPIEXEC-ARGS...: verbs_cases.py, its result line printed after
    after VERBS_CASES_OUT $GUEST_MPIEXEC "$@" python3 tests/rdma/verbs_cases.py
}
export -f after cases

yama() {  # single copies under Ubuntu's default Yama scope (this kernel has Yama; the host's
    # has not), over shm, the ranks without CAP_SYS_PTRACE (which passes Yama; as another
    # user they could not read a CI checkout of mode 0700 through the share)
    local old rc=0 nocap="setpriv --bounding-set -sys_ptrace --inh-caps -sys_ptrace"
    old=$(cat /proc/sys/kernel/yama/ptrace_scope) || { echo "no Yama in this kernel"; return 1; }
    echo 1 > /proc/sys/kernel/yama/ptrace_scope
    for n in 2 3; do
        GPURT_TRANSPORTS= $nocap $GUEST_MPIEXEC -n $n python3 tests/yama_cases.py cma || rc=1
    done
    GPURT_TRANSPORTS= GPURT_SHM_PTRACER=0 $nocap $GUEST_MPIEXEC -n 2 \
        python3 tests/yama_cases.py nocma || rc=1
    echo "$old" > /proc/sys/kernel/yama/ptrace_scope
    return $rc
}
export -f yama

case $mode in
one)
    section yama yama
    export GPURT_TRANSPORTS=verbs
    section cases2 cases -n 2
    section cases3 cases -n 3
    section upto2 $GUEST_MPIEXEC -n 2 python3 tests/upto_cases.py
    section upto2_big env UPTO_LONG=big $GUEST_MPIEXEC -n 2 python3 tests/upto_cases.py
    # the full algorithm sweep on 2 ranks; on 3 and on device buffers the transport's
    # share of it (every algorithm's messages at every size: tests/mpi_sweep.py) -- each
    # case takes ~60 ms under TCG, and the host sweeps the rest over shm and tcp
    section sweep2 $GUEST_MPIEXEC -n 2 python3 tests/mpi_sweep.py algorithms
    section sweep3 $GUEST_MPIEXEC -n 3 python3 tests/mpi_sweep.py transport
    section qp_error failures qp_error 2
    # a third rank's failure named at the deadline of a rank that waits on a slow one
    # (eager ring messages: tests/failed_elsewhere_cases.py), and a gather it had done its
    # part of completes
    section elsewhere bash -c "GPURT_CHECK=0 $GUEST_MPIEXEC -n 5 python3 \
        tests/failed_elsewhere_cases.py ring 5120 && GPURT_CHECK=0 $GUEST_MPIEXEC -n 3 \
        python3 tests/failed_elsewhere_cases.py done"
    section kill failures kill 3
    # device buffers over verbs on gpurt's host-memory stand-in for a GPU (no GPU here):
    # GPUDirect RDMA (device memory registered with the HCA; the stand-in's is host memory,
    # which rxe can register) and, with GPURT_IB_GDR=0, pinned host staging
    export GPURT_DEVICE_BACKEND=standin
    section dev_gdr2 env GPURT_IB_GDR=1 GPURT_STANDIN_DELAY_US=50 GPURT_DEVICE_STAGE_KEEP=0.5 \
        $GUEST_MPIEXEC -n 2 python3 tests/device_cases.py endpoints=verbs+gdr streams reuse \
        alloc inflight order errors gdr_pool_release
    section dev_sweep_gdr2 env GPURT_IB_GDR=1 $GUEST_MPIEXEC -n 2 \
        python3 tests/mpi_sweep.py --device standin transport
    section dev_sweep_staged2 env GPURT_IB_GDR=0 GPURT_DEVICE_STAGE=64K $GUEST_MPIEXEC -n 2 \
        python3 tests/device_cases.py endpoints=verbs+staged streams reuse order
    ;;
two)
    # rxe between two TCG guests: ~13 MB/s, a few ms per round trip (the tuner's constants
    # for it, so that it prefers the hierarchical schedules as on a real cluster)
    export GPURT_TEST_NET=verbs GPURT_COST="verbs=2e-3/1.3e7/2e8"
    section multinode after MULTINODE_OUT $GUEST_MPIEXEC -n 4 -ppn 2 python3 \
        tests/multinode_check.py 2 transport
    section cases_2x2 env GPURT_TRANSPORTS=verbs bash -c 'cases -n 4 -ppn 2'
    # stand-in device buffers: cuda_ipc inside a guest, GPUDirect RDMA over verbs between
    section dev_2x2 env GPURT_DEVICE_BACKEND=standin GPURT_IB_GDR=1 $GUEST_MPIEXEC -n 4 \
        -ppn 2 python3 tests/device_cases.py endpoints=cuda_ipc,verbs+gdr streams reuse alloc \
        order errors
    ;;
newer)
    # one guest with Debian 13's user space (RXE_VM_SUITE=trixie: rdma-core and pyverbs
    # 56.1, Python 3.13, numpy 2.2): the transport against a newer pyverbs than bookworm's 44
    section versions bash -c 'python3 -V; dpkg-query -W python3-pyverbs rdma-core python3-numpy'
    export GPURT_TRANSPORTS=verbs
    section cases2 cases -n 2
    section cases3 cases -n 3
    section sweep2 $GUEST_MPIEXEC -n 2 python3 tests/mpi_sweep.py transport
    section qp_error failures qp_error 2
    section kill failures kill 3
    ;;
selftest)
    # the section runner itself (no guest needed; tests/test_verbs.py runs it on the host):
    # a command and a shell function that outlive SECTION_TIMEOUT, each with a child (named
    # $SELFTEST_TAG, so the test finds these and no other sleep on the machine), then one
    # that ends in time
    export SELFTEST_TAG=${SELFTEST_TAG:-gpurt-selftest-child}
    slow_fn() { (exec -a "$SELFTEST_TAG" sleep 300) & wait; }
    export -f slow_fn
    section slow_cmd bash -c '(exec -a "$SELFTEST_TAG" sleep 300) & wait'
    section slow_fn slow_fn
    section quick true
    ;;
*)
    echo "usage: guest_suite.sh one|two|newer|selftest" >&2; exit 2;;
esac
echo "=== DONE"
