#!/bin/bash
# rxe_vm.sh - run a command inside a throw-away Linux guest that has a real RDMA
# verbs device (Soft-RoCE, rdma_rxe) called rxe0.  gpurt's own copy of the runner
# in /work/shared/rdma-vm (run-in-rxe-vm.sh); tests/rdma/harness.py drives it.
#
# Usage:  rxe_vm.sh [-s SHARE_DIR] [-t TIMEOUT_S] [-v] [--] COMMAND...
#   SHARE_DIR (default: $PWD) is mounted read-write in the guest at /mnt/host
#   (9p, virtio); COMMAND (one string = a bash command line, several words =
#   an argv) runs under bash in cwd=/mnt/host as root, with rxe0 ready.
#   Its stdout+stderr are streamed to our stdout; our exit code is its exit
#   code (124 on timeout, 125 on VM/infrastructure failure).
#   -v also prints the guest kernel console log.
#   rxe_vm.sh --build   only (re)builds the image if absent or stale.
#   rxe_vm.sh --check   exit 0 if the image is present and current, else 1 (never builds).
#
# Environment: RXE_VM_DIR (default /var/tmp/gpurt-rxe-vm) holds the image in
# $RXE_VM_DIR/img (RXE_VM_SUITE=trixie: a Debian 13 user space in
# $RXE_VM_DIR/img-trixie); a version stamp (a hash of the package list, the modules and
# the build/init code below) is kept in img/STAMP, and a changed stamp rebuilds it
# (RXE_VM_EXTRA_PKGS=a,b adds Debian packages and so changes the stamp too).
# Builds are serialised with flock on $RXE_VM_DIR/.lock; a running guest holds
# that lock shared, so a rebuild waits for the guests of the old image to end.
# RXE_VM_MEM (MiB, default 2048); RXE_VM_SMP (default: nproc, max 4); RXE_VM_ACCEL
# (default tcg: the PVM-based /dev/kvm on our VMs cannot boot stock kernels);
# RXE_VM_HOSTNAME (default rxe-vm) is the guest's host name (kernel parameter
# rxe_host=); RXE_VM_HOSTS="IP=NAME,IP=NAME" adds /etc/hosts lines (rxe_hosts=);
# RXE_VM_MTU (default 9000: rxe0 then runs with an active MTU of 4096) is the MTU of the
# netdev under rxe0 (rxe_mtu=);
# RXE_VM_RUN_DIR: use (and remove at exit) this directory for the run's control
# files instead of a fresh $RXE_VM_DIR/run.XXXXXX;
# RXE_VM_NET (a qemu -netdev spec without id) adds a virtio NIC eth0 and binds
# rxe0 to it with address RXE_VM_IP (default 192.168.78.1/24), so two guests
# form a two-node RoCE fabric, e.g. guest 1:
#   RXE_VM_NET=socket,udp=127.0.0.1:7001,localaddr=127.0.0.1:7000 RXE_VM_IP=192.168.78.1/24
# guest 2: RXE_VM_NET=socket,udp=127.0.0.1:7000,localaddr=127.0.0.1:7001 RXE_VM_IP=192.168.78.2/24
# or, without any port, two unix datagram sockets (what harness.py uses):
#   RXE_VM_NET=dgram,local.type=unix,local.path=/T/a,remote.type=unix,remote.path=/T/b
#
# The guest: Debian bookworm minbase + rdma-core 44 + python3-pyverbs +
# python3-pytest + perftest + numpy, the current Debian bookworm kernel (6.1, rdma_rxe as a
# module; RXE_VM_KV pins an ABI such as 6.1.0-57-amd64), custom PID 1 (no
# systemd). Inside: dummy0 = 192.168.77.1/24 (or eth0 = RXE_VM_IP), rxe0 on it
# (GID index 1 is the IPv4-mapped GID; index 0 the link-local IPv6 one).
# The disk is opened with snapshot=on: guest writes to / are discarded.
set -u
DIR=${RXE_VM_DIR:-/var/tmp/gpurt-rxe-vm}
# the Debian release of the guest's user space: bookworm (rdma-core and pyverbs 44,
# Python 3.11) in $DIR/img, or trixie (56.1, Python 3.13) in $DIR/img-trixie; the kernel
# is the current bookworm one either way
SUITE=${RXE_VM_SUITE:-bookworm}
case $SUITE in
  bookworm) IMG=$DIR/img;;
  trixie) IMG=$DIR/img-trixie;;
  *) echo "[rxe-vm] ERROR: RXE_VM_SUITE=$SUITE: bookworm or trixie" >&2; exit 125;;
esac
# the Debian archive this machine's apt already uses (first URIs:/deb line), unless RXE_VM_MIRROR is set
apt_mirror() {
  { grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}'
    grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | awk '{print $2}'; } | grep -v security | head -1
}
# MPI over two guests (the mpich wheel's hydra + libfabric/UCX, mpi4py) needs nothing beyond
# this list: glibc, libibverbs/librdmacm (rdma-core) and python3 are all it links against.
PKGS=python3,python3-pyverbs,python3-pytest,rdma-core,ibverbs-providers,ibverbs-utils,iproute2,python3-numpy,kmod,perftest,rdmacm-utils,procps${RXE_VM_EXTRA_PKGS:+,$RXE_VM_EXTRA_PKGS}
MODS="virtio_pci virtio_blk ext4 crc32c_generic crc32c_intel crc32_generic crc32_pclmul 9pnet_virtio 9p virtio_net virtio_console rdma_rxe ib_uverbs rdma_ucm ib_umad veth dummy overlay"

log() { echo "[rxe-vm] $*" >&2; }
die() { log "ERROR: $*"; exit 125; }

build_image() {
  set -e
  local t0=$SECONDS
  log "building image in $IMG (needs root, apt, network to the Debian mirror)"
  [ "$(id -u)" = 0 ] || die "build needs root"
  local MIRROR=${RXE_VM_MIRROR:-$(apt_mirror)}
  [ -n "$MIRROR" ] || MIRROR=http://deb.debian.org/debian
  local need=""
  command -v qemu-system-x86_64 >/dev/null || need="$need qemu-system-x86"
  command -v debootstrap >/dev/null || need="$need debootstrap"
  command -v mkfs.ext4 >/dev/null || need="$need e2fsprogs"
  command -v cpio >/dev/null || need="$need cpio"
  command -v depmod >/dev/null || need="$need kmod"
  if [ -n "$need" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null
  fi
  apt-get update -qq
  # current bookworm kernel ABI (e.g. 6.1.0-57-amd64) unless RXE_VM_KV pins one
  local KV=${RXE_VM_KV:-$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{sub("linux-image-","",$2); print $2; exit}')}
  [ -n "$KV" ] || die "cannot resolve the linux-image-amd64 kernel package"
  local KPKG=linux-image-$KV
  rm -rf "$IMG.tmp" "$IMG.new"; mkdir -p "$IMG.tmp"; cd "$IMG.tmp"
  chmod 755 .   # apt-get download runs as _apt where it can
  # 1. kernel + modules from the Debian package (not installed on the host)
  apt-get download "$KPKG" busybox-static >/dev/null 2>apt.log || { cat apt.log >&2; die "apt-get download failed"; }
  dpkg-deb -x ${KPKG}_*.deb kernel
  dpkg-deb -x busybox-static_*.deb bb
  depmod -b kernel "$KV"
  # 2. root filesystem
  debootstrap --variant=minbase --include=$PKGS "$SUITE" rootfs "$MIRROR" > debootstrap.log 2>&1 \
    || { tail -20 debootstrap.log >&2; die "debootstrap failed"; }
  rm -rf rootfs/usr/share/doc/* rootfs/usr/share/man/* rootfs/usr/share/locale/* rootfs/var/cache/apt/archives/*.deb rootfs/var/lib/apt/lists/*
  # copy only the modules we need (+ their dependencies) into rootfs
  local kd=kernel/lib/modules/$KV rd=rootfs/lib/modules/$KV
  mkdir -p "$rd"; cp "$kd"/modules.builtin* "$kd"/modules.order "$rd"/
  for f in $(modprobe -d "$PWD/kernel" -S "$KV" -a --show-depends $MODS | awk '$1=="insmod"{print $2}' | sort -u); do
    local rel=${f#*/lib/modules/$KV/}
    mkdir -p "$rd/$(dirname "$rel")"; cp "$f" "$rd/$rel"
  done
  depmod -b rootfs "$KV"
  cp bb/bin/busybox rootfs/bin/busybox
  echo rxe-vm > rootfs/etc/hostname
  printf "127.0.0.1 localhost\n::1 localhost ip6-localhost\n" > rootfs/etc/hosts
  cat > rootfs/sbin/rxe-init <<'EOF'
#!/bin/bash
# PID 1 of the rxe guest: set up, run /mnt/ctrl/cmd, record rc, power off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
mount -t proc proc /proc; mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /mnt/host /mnt/ctrl
mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /tmp; mount -t tmpfs tmpfs /run
ip link set lo up
ulimit -l unlimited
for m in virtio_console 9pnet_virtio 9p crc32_generic rdma_rxe rdma_ucm ib_umad dummy veth virtio_net; do modprobe $m || echo "rxe-init: modprobe $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 ctrl /mnt/ctrl || echo "rxe-init: ctrl mount failed"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576,cache=loose hostshare /mnt/host || echo "rxe-init: host share mount failed"
# kernel command line: rxe_netdev=/rxe_ip= pick the netdev for rxe0, rxe_host= the host
# name, rxe_hosts=IP=NAME,IP=NAME more /etc/hosts lines (the other guests), rxe_mtu= the
# netdev's MTU (9000: rxe0's active_mtu is then 4096, not 1024 -- 2-3x the bandwidth)
NETDEV=dummy0; IPADDR=192.168.77.1/24; NAME=rxe-vm; HOSTS=; MTU=9000
for a in $(cat /proc/cmdline); do case $a in
  rxe_netdev=*) NETDEV=${a#*=};; rxe_ip=*) IPADDR=${a#*=};; rxe_mtu=*) MTU=${a#*=};;
  rxe_host=*) NAME=${a#*=};; rxe_hosts=*) HOSTS=${a#*=};; esac; done
hostname "$NAME"; echo "$NAME" > /etc/hostname
{ echo "127.0.0.1 localhost"; echo "::1 localhost ip6-localhost"; echo "${IPADDR%/*} $NAME"
  for h in ${HOSTS//,/ }; do [ "${h%%=*}" = "${IPADDR%/*}" ] || echo "${h%%=*} ${h#*=}"; done; } > /etc/hosts
[ "$NETDEV" = dummy0 ] && { ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy; }
ip addr add "$IPADDR" dev "$NETDEV"; ip link set "$NETDEV" mtu "$MTU" up
rdma link add rxe0 type rxe netdev "$NETDEV" || echo "rxe-init: rdma link add failed"
OUT=/dev/null; for p in /dev/vport*p1; do [ -e "$p" ] && OUT=$p; done
cd /mnt/host 2>/dev/null || cd /
bash /mnt/ctrl/cmd > "$OUT" 2>&1 < /dev/null
echo $? > /mnt/ctrl/rc
sync
echo o > /proc/sysrq-trigger
sleep 5; busybox poweroff -f
EOF
  chmod 755 rootfs/sbin/rxe-init
  # 3. initramfs: busybox + modules to mount an ext4 virtio disk, then switch_root
  mkdir -p initrd/bin initrd/lib/modules initrd/dev initrd/proc initrd/sys initrd/newroot
  cp bb/bin/busybox initrd/bin/busybox
  local list=""
  for f in $(modprobe -d "$PWD/kernel" -S "$KV" -a --show-depends virtio_pci virtio_blk crc32c_generic ext4 | awk '$1=="insmod"{print $2}'); do
    local b=$(basename "$f"); case " $list " in *" $b "*) continue;; esac
    cp "$f" initrd/lib/modules/; list="$list $b"
  done
  cat > initrd/init <<EOF
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $list; do /bin/busybox insmod /lib/modules/\$m 2>&1 | /bin/busybox grep -v -e "File exists" -e "crc32c-intel" ; done
for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do [ -b /dev/vda ] && break; /bin/busybox sleep 0.2; done
/bin/busybox mount -t ext4 -o rw /dev/vda /newroot || { echo "initrd: cannot mount /dev/vda"; /bin/busybox poweroff -f; }
/bin/busybox umount /proc /sys
/bin/busybox mount --move /dev /newroot/dev
exec /bin/busybox switch_root /newroot /sbin/rxe-init
EOF
  chmod 755 initrd/init
  (cd initrd && find . | cpio -o -H newc --quiet | gzip -1) > initrd.img
  # 4. ext4 disk image
  local mb=$(( $(du -sm rootfs | cut -f1) + 300 ))
  mkfs.ext4 -q -F -L rxeroot -d rootfs rootfs.img "${mb}M"
  mkdir -p "$IMG.new"
  mv rootfs.img initrd.img "$IMG.new/"; cp kernel/boot/vmlinuz-$KV "$IMG.new/vmlinuz"
  echo "$KV" > "$IMG.new/VERSION"
  echo "$STAMP" > "$IMG.new/STAMP"   # written last: an image without it is incomplete
  cd "$DIR"; rm -rf "$IMG"; mv "$IMG.new" "$IMG"; rm -rf "$IMG.tmp"
  log "image built in $((SECONDS - t0))s: $(du -sh --apparent-size "$IMG" | cut -f1) apparent, $(du -sh "$IMG" | cut -f1) on disk"
  set +e
}

# The version stamp: what the image is made of (bash prints the function without comments,
# so editing a comment does not rebuild, editing the init or the package list does).
STAMP=$( { echo "gpurt-rxe-vm 1"; echo "$PKGS"; echo "$MODS"; echo "${RXE_VM_KV:-}"; declare -f build_image
           [ "$SUITE" = bookworm ] || echo "$SUITE"; } \
         | sha256sum | cut -c1-16)

image_current() {
  [ -f "$IMG/rootfs.img" ] && [ -f "$IMG/vmlinuz" ] && [ -f "$IMG/initrd.img" ] \
    && [ "$(cat "$IMG/STAMP" 2>/dev/null)" = "$STAMP" ]
}

# ensure_image: build once; concurrent callers wait on the lock.  Leaves fd 9 holding the
# lock *shared*: a guest booted from the image keeps it until it ends, so a rebuild (which
# needs it exclusive) never replaces the files under a running or starting guest.
ensure_image() {
  mkdir -p "$DIR" || return 1
  exec 9>"$DIR/.lock"
  flock -s 9
  image_current && return 0
  flock -x 9            # (a conversion: the shared lock is dropped first, so no deadlock)
  if ! image_current; then
    ( build_image ); local rc=$?
    [ $rc = 0 ] && image_current || { log "image build failed (rc=$rc)"; flock -u 9; return 1; }
  fi
  flock -s 9
}

SHARE=$PWD; TIMEOUT=1800; VERBOSE=0
while [ $# -gt 0 ]; do
  case "$1" in
    -s) SHARE=$(cd "$2" && pwd) || die "bad share dir"; shift 2;;
    -t) TIMEOUT=$2; shift 2;;
    -v) VERBOSE=1; shift;;
    --build) ensure_image; exit $?;;
    --check) if image_current; then echo "ready $STAMP $(cat "$IMG/VERSION") $IMG"; exit 0; fi
             if [ -f "$IMG/STAMP" ]; then echo "stale: $IMG has stamp $(cat "$IMG/STAMP"), want $STAMP"
             else echo "missing: no image in $IMG"; fi; exit 1;;
    --stamp) echo "$STAMP"; exit 0;;
    --) shift; break;;
    *) break;;
  esac
done
[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 2; }
ensure_image || die "image build failed"
command -v qemu-system-x86_64 >/dev/null || die "qemu-system-x86_64 missing (apt-get install qemu-system-x86)"

if [ -n "${RXE_VM_RUN_DIR:-}" ]; then RUN=$RXE_VM_RUN_DIR; mkdir -p "$RUN" || die "cannot create $RUN"
else RUN=$(mktemp -d "$DIR/run.XXXXXX") || die "cannot create a run directory"; fi
mkdir -p "$RUN/ctrl"; : > "$RUN/out.log"
# one argument = a shell command line; several = an argv, quoted as given
if [ $# -eq 1 ]; then printf '%s\n' "$1"; else printf '%q ' "$@"; echo; fi > "$RUN/ctrl/cmd"
QPID=""; TPID=""
cleanup() {
  [ -n "$QPID" ] && kill "$QPID" 2>/dev/null && sleep 0.5 && kill -9 "$QPID" 2>/dev/null
  [ -n "$TPID" ] && kill "$TPID" 2>/dev/null
  rm -rf "$RUN"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

NET=(); KARGS="rxe_host=${RXE_VM_HOSTNAME:-rxe-vm} rxe_mtu=${RXE_VM_MTU:-9000}"
[ -n "${RXE_VM_HOSTS:-}" ] && KARGS="$KARGS rxe_hosts=$RXE_VM_HOSTS"
if [ -n "${RXE_VM_NET:-}" ]; then   # e.g. socket,udp=127.0.0.1:7001,localaddr=127.0.0.1:7000
  IP=${RXE_VM_IP:-192.168.78.1/24}; o4=${IP%/*}; o4=${o4##*.}
  NET=(-netdev "$RXE_VM_NET,id=n0" -device "virtio-net-pci,netdev=n0,mac=52:54:00:78:00:$(printf %02x "$o4")")
  KARGS="$KARGS rxe_netdev=eth0 rxe_ip=$IP"
fi
NCPU=$(nproc); SMP=${RXE_VM_SMP:-$(( NCPU > 4 ? 4 : NCPU ))}
ACCEL=${RXE_VM_ACCEL:-tcg}
if [ "$ACCEL" = tcg ]; then ACC=(-accel tcg,thread=multi,tb-size=256 -cpu max); else ACC=(-accel "$ACCEL" -cpu host); fi
# 9>&- : the image lock stays with this script (held shared until it exits), not with qemu.
# --foreground: timeout keeps qemu in our process group, so killing the group stops it too.
timeout --foreground "$TIMEOUT" qemu-system-x86_64 "${ACC[@]}" -smp "$SMP" -m "${RXE_VM_MEM:-2048}" \
  -nodefaults -no-user-config -display none -monitor none -no-reboot \
  -kernel "$IMG/vmlinuz" -initrd "$IMG/initrd.img" \
  -append "console=ttyS0 root=/dev/vda rw quiet loglevel=3 panic=-1 mitigations=off tsc=reliable $KARGS" "${NET[@]}" \
  -drive "file=$IMG/rootfs.img,if=virtio,format=raw,snapshot=on,cache=unsafe" \
  -virtfs "local,path=$RUN/ctrl,mount_tag=ctrl,security_model=none" \
  -virtfs "local,path=$SHARE,mount_tag=hostshare,security_model=none" \
  -device virtio-serial-pci -chardev "file,id=out,path=$RUN/out.log" -device virtserialport,chardev=out,name=out \
  -serial "file:$RUN/console.log" </dev/null >"$RUN/qemu.log" 2>&1 9>&- &
QPID=$!
tail -n +1 -f --pid=$QPID "$RUN/out.log" 9>&- & TPID=$!
wait "$QPID"; QRC=$?; QPID=""
wait "$TPID" 2>/dev/null; TPID=""
if [ -f "$RUN/ctrl/rc" ]; then RC=$(cat "$RUN/ctrl/rc"); else
  log "guest did not report an exit code (qemu rc=$QRC; timeout ${TIMEOUT}s?)"; RC=125
  [ "$QRC" = 124 ] && { log "TIMEOUT after ${TIMEOUT}s"; RC=124; }
  VERBOSE=1; cat "$RUN/qemu.log" >&2
fi
[ "$VERBOSE" = 1 ] && { log "---- guest console ----"; cat "$RUN/console.log" >&2; }
exit "$RC"
