"""Run under ``mpiexec -n P`` (P >= 2): a send or receive whose buffer shares memory with
a point-to-point request still in flight, where either writes it, raises ValueError on
the rank that posted it (nothing moves, the peer is not told) — before, ``irecv(x)``
then ``isend(x)`` exchanged garbage in silence.  Around a ring (``left`` sends to this
rank, this rank to ``right``), each case's messages are sent only after a world barrier,
so every receive posted before it is in flight:

* ``irecv(x)`` then ``isend(x)`` / ``send(x)``: refused, named; the exchange then
  completes from another buffer, exactly.
* ``irecv`` into two slices that share elements: the second refused; disjoint slices
  pass and are received exactly.
* a large ``isend`` (single-copy on shm: read by the receiver later) then another send of
  the same buffer (reads both: passes), then a receive into part of it: refused while
  the send is in flight (over tcp only where the kernel had not taken it all).
* a PyTorch CPU tensor (where torch is installed), through the general path.
* a collective into a receive's buffer in flight: refused on every rank (the same call
  everywhere: skipped together); the receive then completes exactly.
* sends and receives into an ``iallreduce``'s output, or into its input, while it is in
  flight (rank 0's, whose peers post theirs after a barrier): refused; it is then exact.
* 13 receives in flight (compared through ``_ClashIndex``): a receive and a send into
  one's slice refused, a receive elsewhere passes; after a wait took one out of the list,
  still refused; all exact.
* a reduce off the root (reads ``x`` only) and a broadcast on its root (reads only) of a
  buffer whose send is in flight pass, exactly.
* after all of it the communicator is whole: an allreduce is exact.
"""

import numpy as np

from casekit import ended, start, verdict

world, comm, r, p, chk = start()
right, left = (r + 1) % p, (r - 1) % p
prefix = f"ValueError: rank {r}: "


def refused(text: str, what: str, other: str, verb: str) -> None:
    chk.count += 1
    want = f"{prefix}{what}: its buffer shares memory with that of {other}"
    if not text.startswith(want) or f"still in flight, which {verb} it" not in text:
        chk.bad.append(f"rank {r}: expected {want!r}, got {text!r}")


# 1. irecv(x) then isend(x) to the ring, small (the ring's slots)
x = np.full(64, -1.0)
q = comm.irecv(x, left, 1)
refused(ended(lambda: comm.isend(x, right, 1)), f"send to rank {right} (tag 1)",
        f"recv from rank {left} (tag 1)", "writes")
refused(ended(lambda: comm.send(x, right, 1)), f"send to rank {right} (tag 1)",
        f"recv from rank {left} (tag 1)", "writes")
world.Barrier()
y = np.arange(64.0) + r
comm.send(y, right, 1)
q.wait()
chk.expect("exchange after the refusal", x, np.arange(64.0) + left)

# 2. two receives into slices that share elements
z = np.zeros(96)
q1 = comm.irecv(z[:48], left, 2)
refused(ended(lambda: comm.irecv(z[32:80], left, 3)), f"recv from rank {left} (tag 3)",
        f"recv from rank {left} (tag 2)", "writes")
refused(ended(lambda: comm.recv(z[47:49], left, 3)), f"recv from rank {left} (tag 3)",
        f"recv from rank {left} (tag 2)", "writes")
q2 = comm.irecv(z[48:], left, 3)          # (disjoint: fine)
world.Barrier()
comm.send(np.full(48, r + 10.0), right, 2)
comm.send(np.full(48, r + 20.0), right, 3)
q1.wait()
q2.wait()
chk.expect("disjoint slices", z, np.concatenate([np.full(48, left + 10.0),
                                                 np.full(48, left + 20.0)]))

# 3. a large send in flight: another send of it passes, a receive into it does not
big = np.arange(1 << 20, dtype=np.float64) * (r + 1)       # 8 MiB
s1 = comm.isend(big, right, 4)
s2 = comm.isend(big, left, 5)             # (reads it too)
posted = not s1.done
text = ended(lambda: comm.irecv(big[1000:2000], left, 6))
if posted:
    chk.count += 1
    if text.startswith(prefix + f"recv from rank {left} (tag 6): its buffer shares memory "
                       f"with that of send to rank {right} (tag 4), still in flight, which "
                       "reads it") or (s2 is not s1 and text.startswith(
                           prefix + f"recv from rank {left} (tag 6): its buffer shares "
                           f"memory with that of send to rank {left} (tag 5)")):
        pass
    else:
        chk.bad.append(f"rank {r}: receive into a send's buffer in flight: {text}")
elif text != "ok":
    chk.bad.append(f"rank {r}: the send was complete, yet the receive: {text}")
world.Barrier()
got_l = np.empty(1 << 20)
got_r = np.empty(1 << 20)
qa = comm.irecv(got_l, left, 4)
qb = comm.irecv(got_r, right, 5)
for q in (s1, s2, qa, qb):
    q.wait()
if not posted:      # (its receive was posted after all: its message is owed)
    comm.send(np.zeros(1000), right, 6)
    comm.recv(np.empty(1000), left, 6)
chk.expect("large from the left", got_l, np.arange(1 << 20, dtype=np.float64) * (left + 1))
chk.expect("large from the right", got_r, np.arange(1 << 20, dtype=np.float64) * (right + 1))
chk.count += 1
if comm.rank == 0 and comm.transport_of.get(right) == "shm" and not posted:
    chk.bad.append("rank 0: a single-copy send on shm was complete before its receive")

# 4. a PyTorch CPU tensor (the general path)
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    t = torch.zeros(16, dtype=torch.float32)
    q = comm.irecv(t, left, 7)
    refused(ended(lambda: comm.isend(t[4:8], right, 7)), f"send to rank {right} (tag 7)",
            f"recv from rank {left} (tag 7)", "writes")
    world.Barrier()
    comm.send(torch.full((16,), float(r)), right, 7)
    q.wait()
    chk.expect("torch", t.numpy(), np.full(16, float(left), np.float32))

# 5. a collective into a receive's buffer in flight: refused on every rank (each makes
# the same call: they skip it together), then the receive completes
w = np.zeros(8)
q = comm.irecv(w, left, 8)
text = ended(lambda: comm.allreduce(w))
want = (f"{prefix}allreduce: its buffer shares memory with that of recv from rank {left} "
        f"(tag 8), still in flight, which writes it")
chk.count += 1
if not text.startswith(want):
    chk.bad.append(f"rank {r}: allreduce into a receive's buffer: {text}")
world.Barrier()
comm.send(np.full(8, r + 0.5), right, 8)
q.wait()
chk.expect("receive after the refused allreduce", w, np.full(8, left + 0.5))

# 6. a send or receive into an iallreduce's buffers in flight (rank 0's waits for the
# others', posted after the barrier)
a = np.full(1 << 17, r + 1.0)
b = np.zeros(1 << 17)
if r == 0:
    qa = comm.iallreduce(a, out=b)
    refused(ended(lambda: comm.irecv(b[10:20], left, 9)), f"recv from rank {left} (tag 9)",
            "allreduce (call ", "writes")
    refused(ended(lambda: comm.isend(b[-4:], right, 9)), f"send to rank {right} (tag 9)",
            "allreduce (call ", "writes")
    refused(ended(lambda: comm.irecv(a[:1], left, 9)), f"recv from rank {left} (tag 9)",
            "allreduce (call ", "reads")
world.Barrier()
if r != 0:
    qa = comm.iallreduce(a, out=b)
qa.wait()
chk.expect("iallreduce after the refusals", b, np.full(1 << 17, p * (p + 1) / 2))

# 7. many in flight (compared through an index beyond four): 12 receives into disjoint
# slices of one buffer; a receive and a send into one of them are refused; after a wait
# took one request out of the list (in place), still
m = np.zeros(12 * 16)
first = np.zeros(4)
q0 = comm.irecv(first, left, 19)
qs = [comm.irecv(m[16 * k:16 * (k + 1)], left, 20 + k) for k in range(12)]
refused(ended(lambda: comm.irecv(m[16 * 7 + 3:16 * 7 + 5], left, 40)),
        f"recv from rank {left} (tag 40)", f"recv from rank {left} (tag 27)", "writes")
refused(ended(lambda: comm.isend(m[16 * 3:16 * 3 + 1], right, 40)),
        f"send to rank {right} (tag 40)", f"recv from rank {left} (tag 23)", "writes")
other = np.zeros(2)
chk.count += 1
if ended(lambda: qs.append(comm.irecv(other, left, 41))) != "ok":
    chk.bad.append(f"rank {r}: a receive into another buffer was refused")
world.Barrier()
comm.send(np.full(4, r + 0.25), right, 19)
world.Barrier()
q0.wait()
chk.expect("first of many", first, np.full(4, left + 0.25))
refused(ended(lambda: comm.irecv(m[16 * 9:16 * 9 + 2], left, 42)),
        f"recv from rank {left} (tag 42)", f"recv from rank {left} (tag 29)", "writes")
refused(ended(lambda: comm.isend(other, right, 42)),      # (posted last before the wait)
        f"send to rank {right} (tag 42)", f"recv from rank {left} (tag 41)", "writes")
extra = np.zeros(8)
qx = comm.irecv(extra, left, 43)        # (appended where the list shrank: indexed too)
refused(ended(lambda: comm.isend(extra[4:6], right, 44)),
        f"send to rank {right} (tag 44)", f"recv from rank {left} (tag 43)", "writes")
world.Barrier()
for k in range(12):
    comm.send(np.full(16, 100.0 * r + k), right, 20 + k)
comm.send(np.zeros(2), right, 41)
comm.send(np.full(8, r + 0.75), right, 43)
for q in qs + [qx]:
    q.wait()
chk.expect("appended after a wait", extra, np.full(8, left + 0.75))
chk.expect("many in flight", m, np.concatenate([np.full(16, 100.0 * left + k)
                                                for k in range(12)]))

# 8. reads pass: a reduce only reads x off the root (its out is x there, never written),
# a broadcast's root only reads its buffer — with a send of that buffer in flight
g = np.full(1 << 20, r + 1.0)
s8 = comm.isend(g, right, 50)
gout = np.zeros(1 << 20)
for name, fn in (("reduce", lambda: comm.reduce(g, out=gout if r == 0 else None, root=0)),
                 ("broadcast", lambda: comm.broadcast(g if r == 0 else gout, root=0))):
    chk.count += 1
    text = ended(fn)
    if text != "ok":
        chk.bad.append(f"rank {r}: {name} that only reads a buffer in flight: {text}")
got = np.empty(1 << 20)
comm.recv(got, left, 50)
s8.wait()
chk.expect("send beside the reduce", got, np.full(1 << 20, left + 1.0))
chk.expect("reduce and broadcast", gout, np.full(1 << 20, p * (p + 1) / 2 if r == 0 else 1.0))

# 9. still whole
chk.expect("allreduce after", comm.allreduce(np.ones(5)), np.full(5, float(p)))
verdict(world, comm, chk, "(p2p clash)" + (" torch" if torch is not None else ""))
