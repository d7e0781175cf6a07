"""The device path of a communicator: which device a rank uses, which endpoint carries
device buffers to each peer, and the per-call context the executor runs device schedules
with.

* At communicator creation (``setup``), every rank says whether it has a device backend
  (``gpurt.device``), binds its device (``GPURT_DEVICE``, else local rank modulo the
  visible devices — several ranks may share one GPU) and tells the others its GPU's UUID.
  Two ranks of one node use ``cuda_ipc`` when both can map each other's memory (the same
  GPU, or P2P both ways), else device buffers are staged through pinned host memory over
  the host transport the pair already uses; the same for ranks of other nodes.
* ``DevCtx`` binds a call's stream, dtype and op for the executor: local copies and
  reductions are queued on the stream, and sinks consume arriving device chunks there.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import Any

import numpy as np

from . import config, device

_U8 = np.dtype(np.uint8)
_BOUND: int | None = None


class DevCtx:
    """One device call: the backend, the stream everything is ordered on, dtype and op."""

    __slots__ = ("be", "stream", "dtype", "op", "isz")

    def __init__(self, be, stream: int, dtype: np.dtype, op):
        self.be, self.stream, self.dtype, self.op = be, stream, dtype, op
        self.isz = dtype.itemsize

    def u8(self, v):
        return self.be.typed(v, _U8)

    def copy(self, dst, src) -> None:
        if dst.nbytes:
            self.be.copy(self.u8(dst), self.u8(src), self.stream)

    def reduce(self, acc, src, out) -> None:
        if out.nbytes:
            self.be.reduce(self.op, acc, src, out, self.stream, dtype=self.dtype)

    def sink(self, dst, acc, plain: bool):
        be, stream = self.be, self.stream
        if plain:
            d8 = self.u8(dst)

            def copy(off: int, chunk) -> None:
                be.copy(d8[off:off + chunk.nbytes], chunk, stream)

            return copy
        acc = dst if acc is None else acc
        isz, op, dtype = self.isz, self.op, self.dtype

        def reduce(off: int, chunk) -> None:
            e0 = off // isz
            e1 = e0 + chunk.nbytes // isz
            be.reduce(op, acc[e0:e1], be.typed(chunk, dtype), dst[e0:e1], stream, dtype=dtype)

        return reduce


def stream_of(be, stream: Any, buf) -> int:
    """The stream a call runs on: ``stream=`` (an int handle, or an object with ``.ptr`` /
    ``.cuda_stream``), else the buffer's ``__cuda_array_interface__`` stream, else — for a
    PyTorch tensor — PyTorch's current stream on its device, else the backend's (CuPy's)
    current stream."""
    s = _resolve(be, stream, buf)
    if s == 2:
        raise ValueError("the per-thread default stream (handle 2) cannot order gpurt's work "
                         "(gpurt may drive a call from another thread's wait()): pass "
                         "stream= a created stream")
    return s


def other_streams(st: int, *bufs) -> tuple:
    """The ``__cuda_array_interface__`` streams of ``bufs`` (device ``Buf``s or None) that
    are not ``st``, the call's: a consumer orders itself after each one (CAI v3), and a
    result written on ``st`` is made ready on its buffer's own stream too."""
    out: list = []
    for b in bufs:
        s = getattr(b, "stream", None) if b is not None and b.nbytes else None
        if isinstance(s, (int, np.integer)) and int(s) != st and int(s) not in out:
            out.append(int(s))
    return tuple(out)


def order_after(be, st: int, others: tuple, ev) -> None:
    """Queue on ``st`` a wait for the work queued so far on each of ``others`` (one event,
    recorded again for each: a stream's wait takes the event's state when it is queued);
    never a host wait."""
    for s in others:
        be.record(ev, s)
        be.wait_event(st, ev)


def ready_on(be, st: int, outs: tuple, ev) -> None:
    """Record ``ev`` on ``st`` after the work queued so far (a call's result) and make each
    of ``outs`` — the result's buffer's own streams — wait for it; never a host wait."""
    be.record(ev, st)
    for s in outs:
        be.wait_event(s, ev)


def _resolve(be, stream: Any, buf) -> int:
    buf_stream = buf.stream
    if stream is None and buf_stream is None and \
            (type(buf.owner).__module__ or "").startswith("torch"):
        import torch
        return int(torch.cuda.current_stream(buf.owner.device).cuda_stream)
    for s in (stream, buf_stream):
        if s is None:
            continue
        if isinstance(s, (int, np.integer)):
            return int(s)
        for attr in ("ptr", "cuda_stream"):
            v = getattr(s, attr, None)
            if v is not None:
                return int(v)
        raise TypeError(f"stream={s!r}: pass an int handle or a stream object with .ptr "
                        f"(CuPy) or .cuda_stream (PyTorch)")
    return be.current_stream()


def wanted() -> tuple[bool, str]:
    """Should this process set up a device backend at all?  (cheap: no CuPy import when
    CuPy is not installed)"""
    name = str(config.get("GPURT_DEVICE_BACKEND")).strip().lower()
    if name in ("none", "off", "0"):
        return False, f"GPURT_DEVICE_BACKEND={name}"
    if name in ("", "auto", "cuda") and importlib.util.find_spec("cupy") is None:
        return False, "CuPy is not installed (pip install cupy-cuda12x)"
    return True, ""


def setup(comm) -> None:
    """Collective over ``comm.mpi``: decide the device endpoints (see the module text).
    Sets ``comm.dev`` (the backend or None), ``comm.dev_why``, ``comm.dev_endpoints``."""
    global _BOUND
    comm.dev, comm.dev_endpoints, comm.dev_ipc = None, {}, None
    ok, why = wanted()
    mine: tuple = (False, why, "", -1, False)
    be = None
    bad = ""          # GPURT_DEVICE names no device here: an error on every rank
    if ok:
        ok, why = device.probe()
        if ok:
            try:
                be = device.get()
                if _BOUND is None:   # once per process, by the first communicator's local rank
                    try:
                        d = device.choose_device(comm.local_rank, be.count())
                    except ValueError as e:
                        bad = str(e)
                        raise
                    be.bind(d)
                    _BOUND = be.current()
                d = be.current()
                mine = (True, "", be.uuid(d), d, _gdr(comm))
            except Exception as e:  # noqa: BLE001 - becomes this rank's reason
                mine = (False, f"{type(e).__name__}: {e}", "", -1, False)
        else:
            mine = (False, why, "", -1, False)
    both = comm.mpi.allgather((mine, bad))
    every = [m for m, _ in both]
    bads = [(r, b) for r, (_, b) in enumerate(both) if b]
    if bads:       # (before: that rank went on without a device, and its first device
        # call was a TypeError about a missing backend)
        raise ValueError(f"rank {comm.rank}: gpurt settings not valid on rank(s) "
                         f"{'every rank' if len(bads) == comm.size else ', '.join(str(r) for r, _ in bads)}"
                         f": {bads[0][1]}")
    if not any(e[0] for e in every):
        comm.dev_why = mine[1]
        return        # no rank has a device (the same verdict everywhere): no second round
    # second exchange, on every rank (with or without a device: both are collective):
    # whether it still has a device, and whom it can map (P2P or the same GPU, and
    # cuda_ipc allowed here); rank 0's cost constants
    from gpurt.algorithms import Cost
    from gpurt.transports import device_ipc_enabled
    from gpurt.tuner import transport_cost

    shm = comm._shm()
    ipc_here = shm is not None and shm.seg is not None and device_ipc_enabled()
    row = [False] * comm.size
    if mine[0]:
        try:
            # the peer's GPU in this process's numbering (CUDA_VISIBLE_DEVICES may differ)
            ordinal = {}
            for i in range(be.count()):
                try:
                    ordinal.setdefault(be.uuid(i), i)
                except Exception:  # noqa: BLE001 - an unreadable device is not a peer
                    pass
            for p, (pok, _, uuid, _d, _g) in enumerate(every):
                if not ipc_here or not pok or p == comm.rank or \
                        comm.topo.node_of[p] != comm.node:
                    continue
                if uuid == mine[2]:
                    row[p] = True
                else:
                    o = ordinal.get(uuid)
                    row[p] = o is not None and bool(be.can_access_peer(mine[3], o))
        except Exception as e:  # noqa: BLE001 - this rank then has no device path
            mine = (False, f"{type(e).__name__}: {e}", "", -1, False)
            row = [False] * comm.size
    every_row = comm.mpi.allgather((mine[0], row,
                                    (transport_cost("cuda_ipc"),
                                     int(config.get("GPURT_DEVICE_STAGE")))
                                    if comm.rank == 0 else None))
    comm.dev_why = mine[1]
    if not mine[0]:
        return
    have = [h for h, _, _ in every_row]
    rows = [r for _, r, _ in every_row]
    # rank 0's: every rank must cost calls alike, and cut a staged message into the same
    # chunks (a chunk size set on one rank only was a CollectiveMismatchError about lengths)
    ipc_cost, stage = every_row[0][2]
    from gpurt.transports.cuda_ipc import (CudaIpcTransport, GdrEndpoint, StagedEndpoint,
                                           _Events, _Pinned)

    comm.dev = be
    ipc = CudaIpcTransport(be, shm, comm.rank) if ipc_here else None
    events, pool = _Events(be), _Pinned(be)
    comm.dev_ipc = ipc
    comm.dev_peers = every
    # the device tuner's constants: cuda_ipc inside nodes whose ranks all map each other's
    # memory, else what the host transports cost (staged); between nodes, the network's
    cost, levels = comm._tuner_in[0], dict(comm._tuner_in[1])
    node_ipc = all(rows[a][b] and rows[b][a] for a in range(comm.size)
                   for b in range(comm.size)
                   if a != b and comm.topo.node_of[a] == comm.topo.node_of[b])
    if node_ipc:
        # ranks sharing a GPU share its memory bandwidth (their kernels take turns)
        share = max(Counter(u for ok_, _, u, _d, _g in every if ok_).values())
        ipc_cost = Cost(ipc_cost.alpha, ipc_cost.beta * share, ipc_cost.gamma * share)
        levels["node"] = ipc_cost
        if comm.nnodes == 1:
            cost = levels["net"] = ipc_cost
    comm._dev_costs = (cost, levels)
    for p, ep in comm.endpoints.items():
        if not have[p]:
            continue          # that rank has no device: its device calls raise there
        shm_ep = shm.endpoints.get(p) if shm is not None else None
        if ipc is not None and shm_ep is not None and ep is shm_ep and rows[comm.rank][p] \
                and rows[p][comm.rank]:
            comm.dev_endpoints[p] = ipc.endpoint(p, shm_ep)
        elif getattr(ep, "transport", "") == "verbs" and mine[4] and every[p][4]:
            comm.dev_endpoints[p] = GdrEndpoint(ep, be, events,
                                                StagedEndpoint(ep, be, events, pool, stage))
        else:
            comm.dev_endpoints[p] = StagedEndpoint(ep, be, events, pool, stage)


def _gdr(comm) -> bool:
    """Can this rank's verbs transport register device memory (GPUDirect RDMA)?"""
    if not any(getattr(ep, "transport", "") == "verbs" for ep in comm.endpoints.values()):
        return False
    from gpurt.transports.verbs import gpudirect
    return gpudirect()[0] in ("peermem", "forced")
