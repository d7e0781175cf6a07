#!/bin/sh
# vcluster_exec.sh -- the "ssh" of the virtual cluster (gpurt/launch/vcluster.py).
#
# MPICH hydra's ssh launcher runs `-launcher-exec WRAPPER` exactly like ssh:
#
#     WRAPPER [-x] HOST COMMAND...
#
# This script looks HOST (a node's IP address or host name) up in the cluster's `nodes`
# file and runs COMMAND inside that node: its network, UTS (hostname), mount (private
# /dev/shm) and PID namespaces, entered through the node's init process.  Like sshd, it
# joins the COMMAND words with spaces and hands the string to `sh -c`, so hydra's quoting
# is interpreted exactly as on a real remote host.  The exit status of COMMAND is the exit
# status of this script (nsenter forks into the PID namespace and passes the child's status
# -- or its fatal signal -- through); 255, as with ssh, means the "connection" failed.
#
# The cluster directory (which holds `nodes`) is $GPURT_VCLUSTER_STATE, else the directory
# of this script: VirtualCluster.up() installs a copy of it into the cluster's state dir.
#
# `nodes` holds one line per node:  IP HOSTNAME INIT_PID NETNS
set -u

# Skip the ssh options a launcher may pass (hydra passes -x: no X11 forwarding).
while [ $# -gt 0 ]; do
    case $1 in
        -x|-X|-Y|-q|-T|-t|-tt|-n|-a|-A|-C|-4|-6) shift ;;
        -o|-p|-l|-i|-F|-E|-J) shift 2 ;;
        --) shift; break ;;
        -*) echo "launcher_exec: unsupported ssh option $1" >&2; exit 255 ;;
        *) break ;;
    esac
done

if [ $# -lt 1 ]; then
    echo "usage: vcluster_exec.sh [-x] HOST COMMAND..." >&2
    exit 255
fi
host=$1
shift
if [ $# -lt 1 ]; then
    echo "launcher_exec: no command for $host (interactive logins are not supported)" >&2
    exit 255
fi

state=${GPURT_VCLUSTER_STATE:-$(dirname "$0")}
if [ ! -r "$state/nodes" ]; then
    echo "launcher_exec: no cluster at $state (is it up?)" >&2
    exit 255
fi

init=
while read -r ip name pid ns; do
    if [ "$host" = "$ip" ] || [ "$host" = "$name" ]; then
        init=$pid
        break
    fi
done < "$state/nodes"

if [ -z "$init" ]; then
    echo "launcher_exec: $host is not a node of the cluster at $state" >&2
    exit 255
fi
if [ ! -d "/proc/$init" ]; then
    echo "launcher_exec: node $host is down (init $init is gone)" >&2
    exit 255
fi

exec nsenter --target "$init" --net --uts --ipc --mount --pid -- sh -c "$*"
