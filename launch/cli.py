"""The ``gpurt`` command line (installed as ``gpurt.launch``).

    gpurt --version
    gpurt info [--json] [--env]
    gpurt bench COLLECTIVE -n NRANKS [-b 8 -e 256M -f 2 ...]   (launch/bench.py)
    gpurt tune -n NRANKS -o profile.json                      (launch/tune.py)
    gpurt launch -n NRANKS [--hosts a:4,b:4] PROGRAM [ARGS...]  (launch/launcher.py)
    gpurt topo [-n NRANKS] [--json]                          (launch/topo.py)
"""

from __future__ import annotations

import json
import os
import platform
import sys

import click

from gpurt._version import __version__


def _versions() -> dict[str, str]:
    out = {"gpurt": __version__, "python": platform.python_version()}
    import numpy

    out["numpy"] = numpy.__version__
    try:
        import ml_dtypes

        out["ml_dtypes"] = ml_dtypes.__version__
    except ImportError:
        out["ml_dtypes"] = "missing (no bfloat16)"
    try:
        import mpi4py

        out["mpi4py"] = mpi4py.__version__
    except ImportError:
        out["mpi4py"] = "missing"
    return out


def _mpi_library() -> dict[str, str]:
    """Which MPI library mpi4py loaded, without initialising MPI where nothing has yet
    (MPI_Get_library_version and MPI_Get_version may be called before MPI_Init; a
    singleton MPI_Init of Open MPI leaves a 16 MiB segment in /dev/shm behind)."""
    try:
        if "mpi4py.MPI" not in sys.modules:
            import mpi4py
            mpi4py.rc.initialize = False
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001 - report, don't crash `gpurt info`
        return {"library": f"unavailable: {e}"}
    lib = MPI.Get_library_version().strip().splitlines()[0].strip()
    major, minor = MPI.Get_version()
    return {"library": lib, "standard": f"MPI {major}.{minor}",
            "vendor": "{} {}".format(*MPI.get_vendor()[:1], ".".join(map(str, MPI.get_vendor()[1])))}


def _transports() -> list[dict[str, str]]:
    from gpurt.transports import PLANNED, registered

    rows = []
    for name, loader in registered():
        try:
            ok, why = loader().probe()
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"probe failed: {e}"
        rows.append({"name": name, "available": ok, "why": why})
    rows.append(_cuda_ipc_row(rows))
    for name, why in PLANNED.items():
        rows.append({"name": name, "available": False, "why": why})
    return rows


def _cuda_ipc_row(rows: list[dict]) -> dict:
    """cuda_ipc: available when the device backend is and shm is (its control path)."""
    from gpurt import device, devpath
    from gpurt.transports import device_ipc_enabled

    want, why = devpath.wanted()
    if want:
        want, why = device.probe()
    shm = next((r for r in rows if r["name"] == "shm"), None)
    if want and not (shm and shm["available"]):
        want, why = False, "needs the shm transport (its descriptors and acknowledgements)"
    if want and not device_ipc_enabled():
        want, why = False, "GPURT_TRANSPORTS does not name it: device buffers are staged"
    if want:
        why += ("; device buffers inside a node are read straight from the peer's GPU "
                "memory (same GPU or P2P), staged through pinned host memory otherwise")
    return {"name": "cuda_ipc", "available": want, "why": why}


def _device_backend() -> dict:
    """The device backend gpurt would use, and what it sees (CUDA: versions, GPUs, the
    P2P matrix) — without importing CuPy when it is not installed."""
    from gpurt import device, devpath

    name = device.backend_name()
    want, why = devpath.wanted()
    if not want:
        return {"backend": name, "available": False, "why": why}
    if name == "cuda":
        from gpurt.device_cuda import info as cuda_info
        return cuda_info()
    ok, why = device.probe()
    return {"backend": name, "available": ok, "why": why}


def _launcher() -> dict[str, str]:
    """The launcher ``gpurt launch`` would drive, with its version line."""
    import subprocess

    from gpurt.launch.launcher import LaunchError, find_launcher

    try:
        la = find_launcher()
    except LaunchError as e:
        return {"kind": "none", "why": str(e)}
    version = ""
    if la.kind != "srun" or la.argv:
        try:
            out = subprocess.run(la.argv + ["--version"], capture_output=True, text=True,
                                 timeout=20)
            lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
            version = " ".join(next((ln for ln in lines if "version" in ln.lower()),
                                    lines[0] if lines else "").split())
            if lines and lines[0].upper().startswith("HYDRA"):
                version = "hydra " + version
        except (OSError, subprocess.TimeoutExpired) as e:
            version = f"--version failed: {e}"
    return {"kind": la.kind, "path": " ".join(la.argv), "version": version}


def _devices() -> dict[str, list[str] | str]:
    """GPUs and RDMA devices this machine shows (without importing CuPy or pyverbs)."""
    gpus: list[str] = []
    base = "/proc/driver/nvidia/gpus"
    if os.path.isdir(base):
        for bus in sorted(os.listdir(base)):
            try:
                with open(os.path.join(base, bus, "information")) as f:
                    model = next((ln.split(":", 1)[1].strip() for ln in f
                                  if ln.startswith("Model")), "?")
            except OSError:
                model = "?"
            gpus.append(f"{bus} {model}")
    rdma: list[str] = []
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib):
        for dev in sorted(os.listdir(ib)):
            ports = os.path.join(ib, dev, "ports")
            states = []
            for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
                try:
                    with open(os.path.join(ports, port, "state")) as f:
                        state = f.read().strip()
                    with open(os.path.join(ports, port, "link_layer")) as f:
                        layer = f.read().strip()
                except OSError:
                    state, layer = "?", "?"
                states.append(f"port {port} {state} {layer}")
            rdma.append(f"{dev} ({'; '.join(states) or 'no ports'})")
    return {"gpus": gpus or "none (no NVIDIA driver: /proc/driver/nvidia/gpus)",
            "rdma": rdma or "none (no /sys/class/infiniband: no RDMA device or kernel support)"}


def _simulate() -> str:
    from gpurt.launch.vcluster import available, hydra_mpiexec

    if hydra_mpiexec() is None:
        return ("unavailable: it drives MPICH's hydra mpiexec (namespaces or MPICH cliques), "
                "and this launcher is not one")
    ok, why = available()
    return ("network namespaces (root)" if ok else
            f"MPICH cliques (no namespace cluster: {why})")


def _algorithms() -> dict[str, list[str]]:
    from gpurt.algorithms import REGISTRY

    return {coll: sorted(algs) for coll, algs in REGISTRY.items()}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="gpurt",
                      message="%(prog)s %(version)s")
def main() -> None:
    """gpurt: NCCL-class collectives for Python, MPI as the control plane.

    \b
    Examples:
      gpurt info                  versions, MPI library, transports and why
      gpurt info --json           the same for machines
      gpurt info --env            every GPURT_* variable with its value
      gpurt bench allreduce -n 4 -b 8 -e 256M -f 2 --baseline mpi
                                  nccl-tests-style sweep (gpurt bench --help)
      gpurt tune -n 4 -o prof.json  measure every algorithm; GPURT_PROFILE=prof.json
      gpurt launch -n 4 train.py --lr 0.1
                                  run on 4 ranks; a failed rank is named, with its stderr
      gpurt topo -n 4             nodes, ranks, rails, leaders, transport matrix

    \b
    Shell completion (bash; zsh/fish: zsh_source/fish_source):
      eval "$(_GPURT_COMPLETE=bash_source gpurt)"
    """


def _native_board() -> dict:
    """Whether the shm board's blocking round runs compiled (gpurt._fastboard)."""
    from gpurt import config
    from gpurt.transports import shm_board

    if shm_board.NATIVE is None:
        return {"built": False, "in_use": False, "why": shm_board.NATIVE_WHY}
    if not config.get("GPURT_NATIVE"):
        return {"built": True, "in_use": False, "why": "built; off (GPURT_NATIVE=0)"}
    return {"built": True, "in_use": True,
            "why": "gpurt._fastboard: the board's blocking round and reads; the staged "
                   "allreduce's round; shm_direct's shares by process_vm_readv/writev; "
                   "the shm cooperative single copy"}


def _host_memory() -> dict:
    """Node-shared arrays (comm.empty) and streaming copies: available here, and how."""
    from gpurt import config, memcopy

    shared = hasattr(os, "memfd_create")
    why = ("comm.empty/zeros (gpurt.empty): memfd arrays; single-copy messages from or into "
           "them are memcpy through a mapping (/proc/<pid>/fd), probed between the ranks of "
           "each node at start" if shared else "no memfd_create on this platform")
    if shared and not config.get("GPURT_SHM_SHARED"):
        why = "comm.empty/zeros allocate shared arrays; the shm transport treats them as any "\
              "other array (GPURT_SHM_SHARED=0)"
    nt = memcopy.streaming_why()
    llc = memcopy.llc_bytes()
    from gpurt.transports import shm_direct
    from gpurt.transports.shm import STAGE_AUTO

    def mib(th: dict) -> str:
        on = [f"{c} from {v / 2**20:g} MiB" for c, v in th.items() if v]
        return ", ".join(on) if on else "off"

    dmap = shm_direct.thresholds(config.get("GPURT_SHM_DIRECT"), shm_direct.AUTO_MAP)
    dcma = shm_direct.thresholds(config.get("GPURT_SHM_DIRECT_CMA"), shm_direct.AUTO_CMA)
    stage = config.get("GPURT_SHM_STAGE")
    auto = stage == "auto"
    stage = (STAGE_AUTO if auto else int(stage)) if dcma["allreduce"] else 0
    direct = shared and any(dmap.values()) or any(dcma.values())
    direct_why = (f"one-node collectives as loads and stores into every rank's buffers; "
                  f"comm.empty arrays: {mib(dmap)} (GPURT_SHM_DIRECT); other arrays, "
                  f"through process_vm_readv/writev: {mib(dcma)} (GPURT_SHM_DIRECT_CMA), "
                  f"an allreduce up to {stage / 2**20:g} MiB staged through the board "
                  f"instead{' where process_vm_readv cannot be used' if auto else ''} "
                  f"(GPURT_SHM_STAGE, at most 32 MiB / local ranks per buffer); "
                  f"algo='shm_direct' forces it") if direct else \
        "off (GPURT_SHM_DIRECT=0 and GPURT_SHM_DIRECT_CMA=0)"
    return {"direct": direct, "direct_why": direct_why,
            "shared_arrays": shared, "shared_why": why, "streaming": not nt,
            "streaming_from": memcopy.threshold() if not nt else 0, "llc_bytes": llc,
            "streaming_why": nt or (
                f"host copies of >= {memcopy.threshold() / 2**20:g} MiB use non-temporal "
                f"stores (GPURT_NT_COPY={config.get('GPURT_NT_COPY')}; last-level cache "
                f"{llc / 2**20:g} MiB, counted up to {memcopy.LLC_MAX >> 20} MiB, shared by the ranks of a node: the threshold is "
                f"divided by the local ranks once a communicator exists)")}


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.option("--env", "show_env", is_flag=True, help="Also list every GPURT_* variable.")
def info(as_json: bool, show_env: bool) -> None:
    """Versions, the MPI library in use, and which transports are available (and why not).

    \b
    Examples:
      gpurt info
      GPURT_SHM_DIR=/tmp gpurt info --json
    """
    from gpurt import config

    # a variable that is not valid is reported (and makes the exit status 1); the rest of
    # the report shows what gpurt does with it at its default, which is what it would be
    # told to do once the value is fixed — computing it with the bad value was a traceback
    problems = config.problems()
    bad = {v.name for v in config.VARIABLES if any(t.startswith(v.name + "=")
                                                   for t in problems)}
    saved = {n: os.environ.pop(n) for n in bad if n in os.environ}
    config.reload()
    try:
        data = _info_data()
    finally:
        os.environ.update(saved)
        config.reload()
    data["problems"] = problems
    if show_env:
        data["env"] = [{"name": n, "default": d, "value": v, "doc": doc,
                        "valid": n not in bad}
                       for n, d, v, doc in config.table()]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        raise SystemExit(1 if problems else 0)
    _info_text(data, show_env)
    if problems:
        click.echo("settings not valid (the report above shows them at their defaults):",
                   err=True)
        for t in problems:
            click.echo(f"  {t}", err=True)
        raise SystemExit(1)


def _info_data() -> dict:
    return {
        "versions": _versions(),
        "mpi": _mpi_library(),
        "platform": {"machine": platform.machine(), "system": platform.system(),
                     "release": platform.release(), "cpus": os.cpu_count()},
        "launcher": _launcher(),
        "devices": _devices(),
        "device_backend": _device_backend(),
        "simulate": _simulate(),
        "transports": _transports(),
        "native_board": _native_board(),
        "host_memory": _host_memory(),
        "algorithms": _algorithms(),
    }


def _info_text(data: dict, show_env: bool) -> None:
    v = data["versions"]
    click.echo(f"gpurt {v['gpurt']}  (python {v['python']}, numpy {v['numpy']}, "
               f"mpi4py {v['mpi4py']}, ml_dtypes {v['ml_dtypes']})")
    m = data["mpi"]
    click.echo(f"MPI: {m.get('library')}" + (f"  [{m['standard']}]" if "standard" in m else ""))
    la = data["launcher"]
    click.echo(f"launcher: {la['kind']} " + (f"{la['path']}  ({la['version']})" if "path" in la
                                             else la.get("why", "")))
    p = data["platform"]
    click.echo(f"platform: {p['system']} {p['release']} {p['machine']}, {p['cpus']} CPUs")
    d = data["devices"]
    for what in ("gpus", "rdma"):
        val = d[what]
        click.echo(f"{what}: " + (", ".join(val) if isinstance(val, list) else val))
    db = data["device_backend"]
    click.echo(f"device backend: {db.get('backend')} " +
               ("yes  " if db.get("available") else "no   ") + str(db.get("why", "")))
    for g in db.get("gpus", []):
        click.echo(f"  GPU {g.get('index')}: {g.get('name', '?')} {g.get('memory', '')} "
                   f"cc {g.get('compute_capability', '?')} {g.get('pci', '')} "
                   f"{g.get('uuid', '')}")
    if db.get("p2p"):
        click.echo(f"  P2P: {db['p2p']}")
    click.echo(f"gpurt launch --simulate: {data['simulate']}")
    click.echo("transports:")
    for t in data["transports"]:
        mark = "yes" if t["available"] else "no "
        click.echo(f"  {t['name']:<9} {mark}  {t['why']}")
    nb = data["native_board"]
    click.echo(f"compiled board round: {'yes' if nb['in_use'] else 'no '}  {nb['why']}")
    hm = data["host_memory"]
    click.echo(f"shared arrays:        {'yes' if hm['shared_arrays'] else 'no '}  "
               f"{hm['shared_why']}")
    click.echo(f"streaming copies:     {'yes' if hm['streaming'] else 'no '}  "
               f"{hm['streaming_why']}")
    click.echo(f"direct (shm_direct):  {'yes' if hm['direct'] else 'no '}  "
               f"{hm['direct_why']}")
    click.echo("algorithms (GPURT_ALGO=collective:name):")
    for coll, names in data["algorithms"].items():
        click.echo(f"  {coll:<15} {', '.join(names)}")
    click.echo("  (and shm_board for every collective: a one-round protocol of the shm "
               "transport, on communicators within one node, for data up to GPURT_SHM_BOARD;")
    click.echo("   shm_direct for allreduce, reduce, reduce_scatter, allgather, alltoall, "
               "broadcast on one node: see 'direct' above;")
    click.echo("   hierarchical for allreduce, reduce_scatter, allgather, broadcast, reduce on "
               "communicators spanning nodes: stages on node/rail subgroups, pipelined)")
    if show_env:
        click.echo("environment:")
        for e in data["env"]:
            val = e["value"] or f"(default {e['default']!r})"
            if not e["valid"]:
                val += "   <- NOT VALID (see below)"
            click.echo(f"  {e['name']:<17} {val}\n      {e['doc']}")


from gpurt.launch.bench import bench_command  # noqa: E402 - after main, to attach to it
from gpurt.launch.tune import tune_command  # noqa: E402

main.add_command(bench_command, "bench")
main.add_command(tune_command(), "tune")


@main.command("flight")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
def flight(directory: str) -> None:
    """Line up the flight records that failed ranks wrote to GPURT_FLIGHT_DIR: the first
    call not completed everywhere, who entered it, who never did.

    \b
    Example:
      GPURT_FLIGHT_DIR=/tmp/fl mpiexec -n 8 python train.py   # ... a hang, a timeout
      gpurt flight /tmp/fl
    """
    from gpurt.flight import main as flight_main

    raise SystemExit(flight_main([directory]))

from gpurt.launch.launcher import launch_command  # noqa: E402
from gpurt.launch.topo import topo_command  # noqa: E402

main.add_command(launch_command(), "launch")
main.add_command(topo_command(), "topo")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
