#!/usr/bin/env python3
"""Host side of the Soft-RoCE test harness: gpurt + MPI inside one or two QEMU guests with a
real verbs device (rxe0).  Standard library only.  See tests/rdma/README.md.

    import harness                          # with tests/rdma on sys.path
    harness.ensure_image()                  # build the guest image once (rxe_vm.sh --build)
    harness.stage(root)                     # root/.rxe/site: gpurt wheel + mpi4py + mpich + click
    rc, out = harness.run('$GUEST_MPIEXEC -n 4 -ppn 2 python3 prog.py', nodes=2)

CLI (stage + run, prints the output, exits with the guest command's exit status)::

    python3 tests/rdma/harness.py [--nodes 2] [--timeout S] [--env K=V]... -- COMMAND
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

__all__ = ["GUEST_ROOT", "NODE_IPS", "NODE_NAMES", "PINS", "ROOT", "LAST_RUN", "ensure_image",
           "guest_env", "ib_write_bw_command", "image_ready", "run", "site_dir", "stage"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent                        # the project (shared at /mnt/host)
RXE_VM = HERE / "rxe_vm.sh"
GUEST_ROOT = "/mnt/host"
SITE_REL = ".rxe/site"                           # (bookworm's; site_rel() for the current suite)
GUEST_SITE = f"{GUEST_ROOT}/{SITE_REL}"
NODE_IPS = ("192.168.78.1", "192.168.78.2")      # eth0 + rxe0 of node0 / node1 (nodes=2)
NODE_NAMES = ("node0", "node1")
SINGLE_IP = "192.168.77.1"                       # dummy0 + rxe0 of a lone guest (nodes=1)
AGENT_PORT = 7777

#: What the guest gets from PyPI besides the project.  numpy and pyverbs come from Debian
#: (python3-numpy 1.24, python3-pyverbs 44) and are never shipped: everything is installed
#: with --no-deps.  ml_dtypes is left out: 0.5+ needs numpy >= 2 (gpurt.ops falls back).
#: Override with RXE_SITE_PINS="mpi4py==4.1.2 mpich==5.0.2 click==8.5.1 [more==x.y]".
PINS = {"mpi4py": "4.1.2", "mpich": "5.0.2", "click": "8.5.1"}
#: The guest's Python: Debian bookworm's CPython 3.11, glibc 2.36, x86_64.
GUEST_PY = ("3.11", "cp", "cp311")
#: The guests' Debian user space, chosen by RXE_VM_SUITE (read at every call, so one
#: process may use both): bookworm (the default: rdma-core and pyverbs 44, Python 3.11,
#: numpy 1.24) or trixie (rdma-core and pyverbs 56.1, Python 3.13, numpy 2.2) — the
#: pyverbs a distribution ships and a newer one.  Each has its own image (rxe_vm.sh), site
#: and wheels; the project's wheel is shared (its extension, built for the host's
#: Python, loads only where the guest's Python is the same: elsewhere gpurt runs its
#: Python round, as it does wherever the extension is missing).
SUITES = {
    "bookworm": {"py": GUEST_PY, "glibc": 36, "site": SITE_REL, "wheels": "wheels"},
    "trixie": {"py": ("3.13", "cp", "cp313"), "glibc": 41, "site": ".rxe/site-trixie",
               "wheels": "wheels-trixie"},
}


def suite() -> str:
    name = os.environ.get("RXE_VM_SUITE") or "bookworm"
    if name not in SUITES:
        raise ValueError(f"RXE_VM_SUITE={name!r}: one of {', '.join(SUITES)}")
    return name


def site_rel() -> str:
    return SUITES[suite()]["site"]


def guest_site() -> str:
    return f"{GUEST_ROOT}/{site_rel()}"


def guest_py() -> tuple[str, str, str]:
    return SUITES[suite()]["py"]


def guest_platforms() -> list[str]:
    return ([f"manylinux_2_{m}_x86_64" for m in range(SUITES[suite()]["glibc"], 4, -1)]
            + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"])

#: Timings of the last run() (host monotonic seconds relative to its start).
LAST_RUN: dict = {}


# -- the image -----------------------------------------------------------------------------------

def image_ready() -> tuple[bool, str]:
    """(True, "ready STAMP KERNEL DIR") if the guest image is built and current; never builds."""
    p = subprocess.run(["bash", str(RXE_VM), "--check"], capture_output=True, text=True,
                       env=dict(os.environ, RXE_VM_SUITE=suite()))
    return p.returncode == 0, (p.stdout + p.stderr).strip()


def ensure_image(timeout: float = 900) -> str:
    """Build the image if it is absent or stale (rxe_vm.sh --build; safe with concurrent
    callers: they wait on its lock).  Raises RuntimeError with the log's tail on failure."""
    ok, what = image_ready()
    if ok:
        return what
    try:
        p = subprocess.run(["bash", str(RXE_VM), "--build"], capture_output=True, text=True,
                           timeout=timeout, start_new_session=True,
                           env=dict(os.environ, RXE_VM_SUITE=suite()))
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        raise RuntimeError(f"rxe image build did not finish in {timeout:.0f} s\n{out[-3000:]}") \
            from None
    ok, what = image_ready()
    if p.returncode != 0 or not ok:
        raise RuntimeError(f"rxe image build failed (rc={p.returncode}): {what}\n"
                           f"{(p.stdout + p.stderr)[-3000:]}")
    return what


# -- staging the Python side ---------------------------------------------------------------------

def site_dir(root: str | os.PathLike | None = None) -> Path:
    return Path(root or ROOT).resolve() / site_rel()


def _pins() -> dict[str, str]:
    spec = os.environ.get("RXE_SITE_PINS")
    if not spec:
        return dict(PINS)
    pins = {}
    for item in spec.split():
        name, _, version = item.partition("==")
        if not version:
            raise ValueError(f"RXE_SITE_PINS: {item!r} is not NAME==VERSION")
        pins[name] = version
    return pins


def _pip(*args: str, log=None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True,
                       env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1",
                                PIP_ROOT_USER_ACTION="ignore"))
    if log:
        log(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    if p.returncode != 0:
        errs = "\n".join(line for line in (p.stdout + p.stderr).splitlines()
                         if "is ignored: it is neither a file nor a directory" not in line)
        raise RuntimeError(f"pip {args[0]} failed (rc={p.returncode}):\n{errs[-4000:]}")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _guest_tags() -> list[str]:
    v, impl, abi = guest_py()
    tags = ["--only-binary=:all:", "--python-version", v, "--implementation", impl, "--abi", abi]
    for plat in guest_platforms():
        tags += ["--platform", plat]
    return tags


def _fix_shebangs(bindir: Path) -> None:
    """pip --target writes the host interpreter into console scripts; the guest has its own."""
    if not bindir.is_dir():
        return
    for f in bindir.iterdir():
        try:
            with open(f, "rb") as fh:
                head = fh.readline()
            if head.startswith(b"#!") and b"python" in head and head.strip() != b"#!/usr/bin/python3":
                data = f.read_bytes()
                f.write_bytes(b"#!/usr/bin/python3\n" + data[len(head):])
        except (OSError, IsADirectoryError):
            pass


def _stage_deps(site: Path, wheels: Path, pins: dict[str, str], log=None) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    reqs = [f"{n}=={v}" for n, v in sorted(pins.items())]
    files = []
    for name, version in sorted(pins.items()):
        found = [w for w in wheels.glob("*.whl")
                 if _norm(w.name.split("-")[0]) == _norm(name) and w.name.split("-")[1] == version]
        if not found:
            # from PyPI (or pip's cache), for the guest's Python, never the host's
            _pip("download", "--no-deps", *_guest_tags(), "-d", str(wheels), f"{name}=={version}",
                 log=log)
            found = [w for w in wheels.glob("*.whl")
                     if _norm(w.name.split("-")[0]) == _norm(name)
                     and w.name.split("-")[1] == version]
        if not found:
            raise RuntimeError(f"no wheel for {name}=={version} in {wheels}")
        files.append(sorted(found)[-1])
    tmp = site.with_name(site.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    _pip("install", "--no-deps", "--no-index", *_guest_tags(), "--target", str(tmp),
         *map(str, files), log=log)
    # pip --target keeps purelib/platlib and bin/ but silently drops a wheel's other data
    # files: the mpich wheel's lib/ (libmpi.so.12, libfabric, UCX) would be lost.  Copy them.
    for whl in files:
        with zipfile.ZipFile(whl) as z:
            for info in z.infolist():
                m = re.match(r"[^/]+\.data/data/(lib/.+)", info.filename)
                if not m or info.is_dir():
                    continue
                dest = tmp / m.group(1)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(dest, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                mode = (info.external_attr >> 16) & 0o777
                os.chmod(dest, mode or 0o644)
    _fix_shebangs(tmp / "bin")
    (tmp / ".deps-stamp").write_text(json.dumps({"pins": reqs, "guest": guest_py()}))
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)


# Written into the site as sitecustomize.py.  The guests run commands in /mnt/host, the
# project's source tree, and Python puts the cwd ('' for -c/-m) or the script's directory
# first on sys.path: /mnt/host/gpurt (the sources, where gpurt.transports does not exist --
# setup.cfg maps it from transports/) would shadow the staged wheel.  This finder, first on
# sys.meta_path, resolves the wheel's top-level packages from the site dir whatever the cwd;
# then it runs the next sitecustomize on sys.path (Debian's), as if we were not there.
_SITECUSTOMIZE = """\
# written by tests/rdma/harness.py stage(): the staged wheel wins over the source tree
import importlib.machinery as _m, importlib.util as _u, os as _os, sys as _sys
_SITE = _os.path.dirname(_os.path.abspath(__file__))
_NAMES = frozenset({names!r})


class _StagedFirst:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in _NAMES:
            return _m.PathFinder.find_spec(name, [_SITE])
        return None

    @staticmethod
    def invalidate_caches():
        pass


_sys.meta_path.insert(0, _StagedFirst)
_spec = _m.PathFinder.find_spec(
    "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _SITE])
if _spec is not None and _spec.loader is not None:
    _mod = _u.module_from_spec(_spec)
    _spec.loader.exec_module(_mod)
"""


def _copy_project(root: Path, dest: Path) -> None:
    skip = {".git", ".rxe", "build", "dist", "__pycache__", ".pytest_cache", ".venv", "tests",
            "benchmarks", "docs", "examples"}
    shutil.copytree(root, dest, symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in skip or n.endswith(
                        (".egg-info", ".pyc", ".so"))])


def _tree_hash(top: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(filenames):
            f = Path(dirpath) / name
            h.update(str(f.relative_to(top)).encode() + b"\0")
            h.update(f.read_bytes() if not f.is_symlink() else os.readlink(f).encode())
            h.update(b"\0%o\0" % (f.lstat().st_mode & 0o777))
    return h.hexdigest()[:20]


def _project_wheel(src: Path, cache: Path, log=None) -> Path:
    """The project's wheel, built by ``pip wheel --no-deps`` from the copy ``src``; reused
    while the sources are byte-identical (keyed by a hash of the tree)."""
    key = _tree_hash(src)
    hit = sorted((cache / key).glob("*.whl"))
    if hit:
        return hit[-1]
    try:                                # build isolation costs ~6 s; skip it where possible
        import setuptools               # (>= 70.1 has bdist_wheel, older needs `wheel`)
        isolated = int(setuptools.__version__.split(".")[0]) < 70 \
            and importlib.util.find_spec("wheel") is None
    except ImportError:
        isolated = True
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{key}.tmp{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    _pip("wheel", "--no-deps", "-q", *([] if isolated else ["--no-build-isolation"]),
         "-w", str(out), str(src), log=log)
    built = sorted(out.glob("*.whl"))
    if not built:
        raise RuntimeError("pip wheel produced no wheel")
    for old in cache.iterdir():         # keep one wheel: the sources only move forward
        if old != out:
            shutil.rmtree(old, ignore_errors=True)
    out.rename(cache / key)
    return cache / key / built[-1].name


def stage(root: str | os.PathLike | None = None, *, log=None) -> Path:
    """Make ``root/.rxe/site``: what the guests import with PYTHONPATH=/mnt/host/.rxe/site.

    The dependencies (``PINS``: mpi4py, the mpich wheel -- libmpi in site/lib, hydra's mpiexec
    in site/bin -- and click) are installed with ``pip install --no-deps --target`` from wheels
    downloaded for the guest's Python into ``root/.rxe/wheels``, once per set of versions
    (``site/.deps-stamp``).  The project itself is built as a wheel (``pip wheel --no-deps``
    of a copy of the tree, so the build leaves nothing in it; rebuilt whenever a source
    byte changed) and reinstalled every time.
    numpy and pyverbs are the guest's Debian packages.  Returns the site directory."""
    root = Path(root or ROOT).resolve()
    site = root / site_rel()
    rxe = root / ".rxe"
    rxe.mkdir(exist_ok=True)
    pins = _pins()
    want = {"pins": [f"{n}=={v}" for n, v in sorted(pins.items())], "guest": list(guest_py())}
    with open(rxe / "stage.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            have = json.loads((site / ".deps-stamp").read_text())
            have["guest"] = list(have["guest"])
        except (OSError, ValueError, KeyError):
            have = None
        if have != want or not (site / "lib" / "libmpi.so.12").exists() \
                or not (site / "bin" / "mpiexec").exists():
            _stage_deps(site, rxe / SUITES[suite()]["wheels"], pins, log=log)
        with tempfile.TemporaryDirectory(prefix="gpurt-stage-") as tmp:
            src, inst = Path(tmp) / "src", Path(tmp) / "inst"
            _copy_project(root, src)
            whl = _project_wheel(src, rxe / "wheels" / "project", log=log)
            # into a scratch target, then merged: `pip install --target --upgrade` into the
            # site would replace the whole site/bin (mpich's mpiexec) by the wheel's bin/gpurt
            _pip("install", "--no-deps", "--no-index", "--target", str(inst),
                 str(whl), log=log)
            _fix_shebangs(inst / "bin")
            for old in list(site.glob("gpurt")) + list(site.glob("gpurt-*.dist-info")):
                shutil.rmtree(old)
            for item in inst.iterdir():
                if item.name == "bin":
                    (site / "bin").mkdir(exist_ok=True)
                    for f in item.iterdir():
                        with contextlib.suppress(FileNotFoundError):
                            (site / "bin" / f.name).unlink()
                        shutil.move(str(f), site / "bin" / f.name)
                else:
                    if (site / item.name).exists():
                        shutil.rmtree(site / item.name)
                    shutil.move(str(item), site / item.name)
            tops = set()
            for info in site.glob("gpurt-*.dist-info"):
                with contextlib.suppress(OSError):
                    tops |= set((info / "top_level.txt").read_text().split())
            (site / "sitecustomize.py").write_text(
                _SITECUSTOMIZE.format(names=sorted(tops or {"gpurt"})))
    for script in ("guest_rsh.py", "guest_agent.py"):   # hydra execs the rsh directly
        f = root / "tests" / "rdma" / script
        if f.exists() and not os.access(f, os.X_OK):
            f.chmod(f.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return site


# -- running the guests --------------------------------------------------------------------------

def guest_env(nodes: int = 1) -> dict[str, str]:
    """The environment a guest command gets (before run()'s ``env``)."""
    rsh = f"{GUEST_ROOT}/tests/rdma/guest_rsh.py"
    gsite = guest_site()
    mpiexec = f"{gsite}/bin/mpiexec"
    if nodes == 1:
        launch = f"{mpiexec} -launcher fork"
        iface = "lo"
    else:
        launch = (f"{mpiexec} -hosts {','.join(NODE_IPS[:nodes])} -launcher ssh "
                  f"-launcher-exec {rsh} -iface eth0")
        iface = "eth0"
    return {
        "HOME": "/root",
        "PATH": f"{gsite}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": gsite,
        "PYTHONDONTWRITEBYTECODE": "1",        # no __pycache__ written into the shared tree
        # mpi4py dlopens libmpi itself; without a venv prefix it would not look in site/lib
        "MPI4PY_LIBMPI": f"{gsite}/lib/libmpi.so.12",
        # MPICH's ch4 over libfabric's tcp provider on the guests' network (not UCX, which
        # would go looking for InfiniBand devices and find rxe0)
        "MPIR_CVAR_CH4_NETMOD": "ofi",
        "FI_PROVIDER": "tcp",
        "FI_TCP_IFACE": iface,
        "GUEST_MPIEXEC": launch,
        "GUEST_RSH": rsh,
        "GUEST_NODES": str(nodes),
        "GUEST_IPS": " ".join(NODE_IPS[:nodes]) if nodes > 1 else SINGLE_IP,
        "GUEST_HOSTNAMES": " ".join(NODE_NAMES[:nodes]),
        "RXE_AGENT_PORT": str(AGENT_PORT),
    }


def _pdeathsig():
    """In the child: get SIGTERM when the harness dies (rxe_vm.sh then stops its qemu)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except Exception:                           # noqa: BLE001
        pass


class _Guest:
    def __init__(self, name: str, argv: list[str], env: dict, stream=None):
        self.name, self.stream = name, stream
        self.chunks: list[str] = []
        self.first_output: float | None = None
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_pdeathsig)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        fd = self.proc.stdout.fileno()
        decode = codecs.getincrementaldecoder("utf-8")(errors="replace").decode
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            if self.first_output is None:
                self.first_output = time.monotonic()
            text = decode(data)
            self.chunks.append(text)
            if self.stream is not None:
                with contextlib.suppress(Exception):
                    self.stream.write(text)
                    self.stream.flush()

    def output(self) -> str:
        return "".join(self.chunks)

    def terminate(self) -> None:
        """SIGTERM the runner's process group: rxe_vm.sh's trap stops qemu (which is in the
        same group: timeout --foreground) and removes its run directory."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def reap(self, grace: float) -> None:
        """Wait up to ``grace`` s, then SIGKILL whatever is left of the group."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)   # stragglers (qemu, tail) of the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.reader.join(5)
        with contextlib.suppress(Exception):
            self.proc.stdout.close()


def _stop_all(guests: list[_Guest], grace: float = 8.0) -> None:
    for g in guests:
        g.terminate()
    end = time.monotonic() + grace
    for g in guests:
        g.reap(max(0.0, end - time.monotonic()))


def _reap_stale(root: Path) -> None:
    """Remove the run directories of harness processes that died without cleaning up
    (SIGKILL): ``.rxe/runs/<pid>-*`` and ``$TMPDIR/gpurt-rxe-<pid>-*``.  (Their guests are
    gone already: each rxe_vm.sh gets SIGTERM when its harness dies, PR_SET_PDEATHSIG.)"""
    cands = list((root / ".rxe" / "runs").glob("*-*")) \
        + list(Path(tempfile.gettempdir()).glob("gpurt-rxe-*-*"))
    for d in cands:
        m = re.match(r"^(?:gpurt-rxe-)?(\d+)-", d.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


#: How long the guests get to boot (and, with two, for node1's agent to answer) before the
#: harness gives up on that boot, says why, and boots them again (once).  No project code has
#: run by then: a guest that never came up is the emulator's failure, not the command's.
BOOT_TIMEOUT = float(os.environ.get("RXE_BOOT_TIMEOUT", "240"))
BOOT_TRIES = int(os.environ.get("RXE_BOOT_TRIES", "2"))


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({exc.strerror or exc})"
    got = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join(got) if got else "(empty)"


def _diagnose(guests: list[_Guest], host_tmp: Path, t0: float) -> str:
    """What each guest got to, for a boot or run that did not end: its markers (guest
    uptime when node*.sh began, when node1's agent answered), whether qemu is alive, and the
    tails of its console and qemu logs.  Read before the guests are stopped (rxe_vm.sh
    removes its run directory when it ends)."""
    parts = [f"[rxe harness] diagnosis at {time.monotonic() - t0:.0f} s:"]
    for i, g in enumerate(guests):
        run = host_tmp / f"vm{i}"
        marks = []
        for name in ("up", "started"):
            p = run / "ctrl" / name
            if p.exists():
                marks.append(f"{name} (guest uptime {_tail(p, 1).split()[0]} s)")
        alive = "running" if g.proc.poll() is None else f"exited rc={g.proc.returncode}"
        first = "none" if g.first_output is None else f"{g.first_output - t0:.0f} s"
        parts.append(f"  {g.name}: runner {alive}; markers: {', '.join(marks) or 'none'}; "
                     f"first output: {first}")
        parts.append(f"  {g.name} console (last lines):\n"
                     + "\n".join("    " + ln for ln in _tail(run / "console.log", 25).splitlines()))
        parts.append(f"  {g.name} qemu log: {_tail(run / 'qemu.log', 5)}")
    return "\n".join(parts) + "\n"


def run(command: str, nodes: int = 1, timeout: float = 600, env: dict | None = None, *,
        root: str | os.PathLike | None = None, stream=None,
        boot_timeout: float | None = None) -> tuple[int, str]:
    """Boot ``nodes`` (1 or 2) guests sharing ``root`` (default: this project) at /mnt/host and
    run ``command`` (bash) on node 0 in /mnt/host with ``guest_env(nodes)`` + ``env``.

    Returns (exit status, output): the command's status (124: timeout, 125: VM failure) and
    node 0's stdout+stderr, followed by node 1's lines prefixed ``[node1]`` if it printed
    anything.  With ``stream`` (a text file), node 0's output is also written there live.

    Time limits: the guests get ``boot_timeout`` s (default ``BOOT_TIMEOUT``, 240) to boot
    and, with two, for node1's agent to answer; a boot that does not get there is stopped,
    its diagnosis (markers, console, qemu log) goes into the output, and the guests boot
    again, ``BOOT_TRIES`` (2) boots in all.  The command then gets ``timeout`` s; on a
    timeout the output ends with the same diagnosis.  No qemu, run directory or socket
    outlives run(), also on an exception or KeyboardInterrupt.  The image must be built
    (ensure_image(), called here, builds it outside these limits) and ``root`` staged
    (stage())."""
    if nodes not in (1, 2):
        raise ValueError("nodes must be 1 or 2")
    root = Path(root or ROOT).resolve()
    if not (root / site_rel() / "gpurt").is_dir():
        raise RuntimeError(f"{root / site_rel()} is not staged: call stage({str(root)!r}) first")
    ensure_image()
    _reap_stale(root)
    boot_timeout = BOOT_TIMEOUT if boot_timeout is None else float(boot_timeout)
    LAST_RUN.clear()
    t0 = time.monotonic()
    earlier = ""                                  # the diagnoses of boots that failed
    for attempt in range(1, max(1, BOOT_TRIES) + 1):
        rc, out, final = _run_once(command, nodes, timeout, env, root, stream, boot_timeout,
                                   t0, last=attempt >= max(1, BOOT_TRIES))
        LAST_RUN["boots"] = attempt
        if final:
            return rc, earlier + out
        msg = (f"[rxe harness] boot {attempt} failed: the guests did not come up "
               f"(rc {rc})\n")
        earlier += msg + out
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.write(msg)
                stream.flush()
    return rc, earlier


def _marker(host_tmp: Path, i: int, name: str) -> bool:
    return (host_tmp / f"vm{i}" / "ctrl" / name).exists()


def _run_once(command: str, nodes: int, timeout: float, env: dict | None, root: Path, stream,
              boot_timeout: float, t0: float, last: bool) -> tuple[int, str, bool]:
    """One boot of the guests: (rc, output, final).  ``final`` is False when node 0 never
    started the command (the guests did not come up, or node1's agent did not answer) and
    ``last`` is False: the caller boots again."""
    rid = f"{os.getpid()}-{secrets.token_hex(4)}"
    shared = root / ".rxe" / "runs" / rid        # seen by the guests at /mnt/host/.rxe/runs/ID
    host_tmp = Path(tempfile.mkdtemp(prefix=f"gpurt-rxe-{os.getpid()}-"))  # qemu runs, sockets
    guests: list[_Guest] = []
    tb = time.monotonic()
    try:
        shared.mkdir(parents=True, mode=0o700)
        gshared = f"{GUEST_ROOT}/.rxe/runs/{rid}"
        _write(shared / "token", secrets.token_hex(32) + "\n", 0o600)
        genv = guest_env(nodes)
        genv["RXE_AGENT_TOKEN_FILE"] = f"{gshared}/token"
        genv.update({k: str(v) for k, v in (env or {}).items()})
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in genv.items())
        rsh = f"python3 {GUEST_ROOT}/tests/rdma/guest_rsh.py"
        # markers in the run's control folder (9p, uncached): the host polls them
        up = "cut -d' ' -f1 /proc/uptime > /mnt/ctrl/up\n"
        started = "cut -d' ' -f1 /proc/uptime > /mnt/ctrl/started\n"
        _write(shared / "cmd.sh", command + "\n")
        node0 = [up, exports, f"cd {GUEST_ROOT}\n"]
        if nodes == 2:
            wait_s = max(10, int(boot_timeout - (time.monotonic() - tb) - 5))
            node0.append(f"{rsh} --wait {NODE_IPS[1]} {wait_s} || "
                         f"{{ echo 'rxe harness: the agent on node1 does not answer' >&2; exit 125; }}\n")
        node0.append(started)
        node0.append(f"bash {gshared}/cmd.sh\nrc=$?\n")
        if nodes == 2:
            node0.append(f"{rsh} --quit {NODE_IPS[1]} >/dev/null 2>&1\n")
        node0.append("exit $rc\n")
        _write(shared / "node0.sh", "".join(node0))
        _write(shared / "node1.sh", up + exports + f"cd {GUEST_ROOT}\n"
               f"exec python3 {GUEST_ROOT}/tests/rdma/guest_agent.py --host {NODE_IPS[1]} "
               f"--port {AGENT_PORT} --token-file {gshared}/token "
               f"--max-seconds {int(timeout + boot_timeout) + 30}\n")

        base = dict(os.environ)
        for k in list(base):
            if k.startswith("RXE_VM_") and k not in ("RXE_VM_DIR", "RXE_VM_MEM", "RXE_VM_SMP",
                                                     "RXE_VM_ACCEL", "RXE_VM_MIRROR", "RXE_VM_KV",
                                                     "RXE_VM_EXTRA_PKGS", "RXE_VM_SUITE"):
                del base[k]
        hosts = ",".join(f"{ip}={n}" for ip, n in zip(NODE_IPS, NODE_NAMES))
        vm_timeout = str(int(timeout + boot_timeout) + 20)   # rxe_vm.sh's own limit: a safety net
        for i in range(nodes):
            e = dict(base, RXE_VM_HOSTNAME=NODE_NAMES[i], RXE_VM_RUN_DIR=str(host_tmp / f"vm{i}"))
            if nodes == 2:
                me, peer = host_tmp / f"n{i}.sock", host_tmp / f"n{1 - i}.sock"
                e.update(RXE_VM_NET=f"dgram,local.type=unix,local.path={me},"
                                    f"remote.type=unix,remote.path={peer}",
                         RXE_VM_IP=f"{NODE_IPS[i]}/24", RXE_VM_HOSTS=hosts)
            argv = ["bash", str(RXE_VM), "-s", str(root), "-t", vm_timeout, "--",
                    f"bash {gshared}/node{i}.sh"]
            guests.append(_Guest(NODE_NAMES[i], argv, e, stream if i == 0 else None))
        LAST_RUN.setdefault("started", time.monotonic() - t0)

        # boot: until node 0 starts the command (its "started" marker), it exits, or the
        # boot's time is up
        boot_deadline = tb + boot_timeout
        while not _marker(host_tmp, 0, "started") and guests[0].proc.poll() is None \
                and time.monotonic() < boot_deadline:
            time.sleep(0.25)
        booted = _marker(host_tmp, 0, "started")
        if booted:
            LAST_RUN["command_started"] = time.monotonic() - t0
        elif guests[0].proc.poll() is None or guests[0].proc.returncode == 125:
            # never came up, or node1's agent never answered: say what each guest got to
            diag = _diagnose(guests, host_tmp, t0)
            if guests[0].proc.poll() is None:
                diag = (f"[rxe harness] node0 did not start the command within the boot's "
                        f"{boot_timeout:.0f} s\n") + diag
            guests[0].chunks.append(diag)
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.write(diag)
                    stream.flush()
            _stop_all(guests)
            out = _outputs(guests, nodes, stream)
            return 125, out, last
        # (node 0 ended before the marker with another status: the command's own result,
        #  e.g. an exports line that failed; reported as it is)

        deadline = time.monotonic() + timeout
        rc = None
        try:
            guests[0].proc.wait(max(0.0, deadline - time.monotonic()))
            rc = guests[0].proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
            msg = (f"\n[rxe harness] TIMEOUT: node0's command did not end in {timeout:.0f} s\n"
                   + _diagnose(guests, host_tmp, t0))
            guests[0].chunks.append(msg)
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.write(msg)
                    stream.flush()
        LAST_RUN["node0_end"] = time.monotonic() - t0
        if nodes == 2 and rc != 124:             # the agent was told to quit: node1 powers off
            with contextlib.suppress(subprocess.TimeoutExpired):
                guests[1].proc.wait(min(15.0, max(2.0, deadline - time.monotonic())))
            LAST_RUN["node1_end"] = time.monotonic() - t0
        _stop_all(guests)
        out = _outputs(guests, nodes, stream)
        for i, g in enumerate(guests):
            if g.first_output is not None:
                LAST_RUN[f"node{i}_first_output"] = g.first_output - t0
        LAST_RUN["total"] = time.monotonic() - t0
        return rc, out, True
    finally:
        _stop_all(guests, grace=5)               # (again) exceptions, KeyboardInterrupt
        shutil.rmtree(host_tmp, ignore_errors=True)
        shutil.rmtree(shared, ignore_errors=True)
        with contextlib.suppress(OSError):
            shared.parent.rmdir()                # .rxe/runs, if no other run is using it


def _outputs(guests: list[_Guest], nodes: int, stream) -> str:
    """node 0's output, then node 1's lines prefixed ``[node1] ``."""
    out = guests[0].output()
    if nodes == 2:
        other = guests[1].output().rstrip("\n")
        if other:
            tail = "".join(f"[node1] {line}\n" for line in other.splitlines())
            out += tail
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.write(tail)
                    stream.flush()
    return out


# -- benchmarks ----------------------------------------------------------------------------------

def ib_write_bw_command(size: int = 8 << 20, iters: int = 20, *, port: int = 18515,
                        device: str = "rxe0", gid_index: int = 1) -> str:
    """A guest shell command that runs perftest's ``ib_write_bw`` between two processes on
    ``device`` in the same guest (server in the background, client to 127.0.0.1: the
    out-of-band exchange goes over TCP loopback, the RDMA WRITEs through rxe0) and prints one
    line ``IB_WRITE_BW_MIBS <average MiB/s>`` (exit status 1 and the logs if it failed)."""
    common = f"-d {device} -x {gid_index} -s {size} -n {iters} -p {port} -F"
    return (
        "( _d=$(mktemp -d); "
        f"ib_write_bw {common} >$_d/server 2>&1 & _s=$!; "
        "_ok=; for _i in $(seq 1 50); do "
        f"  if ib_write_bw {common} 127.0.0.1 >$_d/client 2>&1; then _ok=1; break; fi; "
        "  kill -0 $_s 2>/dev/null || break; sleep 0.2; done; "
        "[ -n \"$_ok\" ] || kill $_s 2>/dev/null; wait $_s; "
        f"_bw=$(awk '$1 == \"{size}\" && NF >= 4 {{print $4; exit}}' $_d/client); "
        "if [ -n \"$_ok\" ] && [ -n \"$_bw\" ]; then echo \"IB_WRITE_BW_MIBS $_bw\"; _rc=0; "
        "else echo 'ib_write_bw failed:'; cat $_d/server $_d/client; _rc=1; fi; "
        "rm -rf $_d; exit $_rc )"
    )


# -- CLI -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="harness.py", description="stage the project and run COMMAND in rxe guests",
        usage="%(prog)s [--nodes N] [--suite S] [--timeout S] [--env K=V]... [--no-stage] "
              "-- COMMAND")
    ap.add_argument("--nodes", type=int, default=1, choices=(1, 2))
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("--root", default=None, help="project root to stage and share")
    ap.add_argument("--no-stage", action="store_true", help="use .rxe/site as it is")
    ap.add_argument("--timing", action="store_true", help="print stage/boot timings to stderr")
    ap.add_argument("--suite", choices=sorted(SUITES), default=None,
                    help="the guests' Debian user space (default: RXE_VM_SUITE or bookworm)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.suite:
        os.environ["RXE_VM_SUITE"] = args.suite
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not words:
        ap.error("no COMMAND")
    command = words[0] if len(words) == 1 else shlex.join(words)
    env = dict(kv.split("=", 1) for kv in args.env)
    t = time.monotonic()
    ensure_image()
    t_img = time.monotonic() - t
    t = time.monotonic()
    if not args.no_stage:
        stage(args.root)
    t_stage = time.monotonic() - t
    rc, _ = run(command, nodes=args.nodes, timeout=args.timeout, env=env, root=args.root,
                stream=sys.stdout)
    if args.timing:
        print(f"[rxe harness] image check/build {t_img:.1f} s, stage {t_stage:.1f} s, run "
              + ", ".join(f"{k} {v}" if k == "boots" else f"{k} {v:.1f} s"
                         for k, v in LAST_RUN.items()), file=sys.stderr)
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
