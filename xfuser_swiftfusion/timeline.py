"""A timeline of one attention layer on every rank: the ranks' programs (``strategies/ops.py``)
run against a hardware profile (``hardware.py``).

Every op becomes nodes of one graph over all ranks; a node starts when the nodes it depends
on finished:

- the host issues each rank's ops in order, paying ``attend_call_s`` (plus ``merge_call_s``
  per query chunk) / ``transfer_call_s`` per call; with ``host_waits`` (CPU) it waits for
  each compute call and each wait or barrier, otherwise (GPU) compute calls queue on the
  rank's compute stream and waits and barriers order that stream, while the host runs ahead:
  a call starts on the device once the host issued it, so a host slower than the device
  makes the layer host-bound (``Result.host_s``: when each rank's host finished issuing);
- a transfer starts after the host issued it and the compute stream reached it (a transfer
  is ordered after the compute issued before it, as on a CUDA side stream); two-sided
  messages start when both ends posted them (sends and receives of a pair match in order),
  one-sided ones when the initiator did; then its latency passes, then its bytes flow, at the
  profile's rate for its kind, locality and fan-out (a collective whose peers are on one
  other machine takes the two-machine rate where the profile has one);
- queues: one-sided transfers of a rank's queue run one after another (a stream), at most
  ``one_sided_depth`` at once (the emulation's proxy keeps two in flight); two-sided ones one
  after another with ``two_sided_fifo`` (one NCCL stream per queue), else concurrently with
  one FIFO per peer and direction (gloo's socket per pair);
- a barrier ends ``barrier_s`` (``sync_s``) after the last of its ranks arrived; a quiet
  one's arrival also waits for the rank's transfers issued before it.

Shared resources, split by max-min fairness among the jobs in flight (progressive filling:
every job's speed, a fraction of its speed alone, rises together until a resource it uses
is full): each machine's link per direction, each GPU's intra-machine port per direction
(and its inter-machine NIC share, ``inter_gpu_bw``), each rank's device, and on a shared host
(``host_cores``) the host's cores, which the compute calls and the CPU cost of transfers
(``cpu_s_per_byte``) share; without ``host_cores`` that CPU cost lands on each end's rank.

Symmetry: where the ranks of machine m + k run the programs of machine m's with every peer k
machines further on (checked op by op; k the smallest such divisor of N), the timeline repeats
every k machines. Then only the first k machines' ranks are simulated, every other rank folded
onto its image among them: a message between machines keeps its direction's links (each
simulated machine's uplink carries its sends, its downlink its receives, as every machine's
do) and meets its other end by (sender's and receiver's image, machine offset); the host's
cores count k/N for them.
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

from .hardware import HardwareProfile
from .strategies.ops import Attend, Barrier, Copy, Op, Transfer, Wait
from .topology import Topology

_JOIN, _DELAY, _WORK = 0, 1, 2
_EPS = 1e-12


@dataclass
class Result:
    """Finish time of every rank, each rank's compute at full speed (no communication beside
    it; on a shared host at the speed all ranks computing at once get) and when its host
    finished issuing its calls."""

    finish_s: list[float]
    compute_s: list[float]
    host_s: list[float]


class _Graph:
    def __init__(self) -> None:
        self.deps: list[list[int]] = []
        self.kind: list[int] = []
        self.dur: list[float] = []               # delay: seconds; work: seconds alone
        self.demand: list[dict | None] = []      # work: resource -> units

    def add(self, deps, kind: int = _JOIN, dur: float = 0.0, demand: dict | None = None) -> int:
        self.deps.append([d for d in deps if d is not None])
        self.kind.append(kind)
        self.dur.append(dur)
        self.demand.append(demand)
        return len(self.kind) - 1


class _Builder:
    """The graph of every rank's program (module docstring)."""

    def __init__(self, topo: Topology, prof: HardwareProfile, dtype: str, head_dim: int,
                 period: int | None = None) -> None:
        self.topo, self.p, self.dtype, self.D = topo, prof, dtype, head_dim
        self.fold = period is not None and period < topo.nodes
        self.span = (period or topo.nodes) * topo.gpus_per_node  # ranks simulated
        self.g = _Graph()
        self.caps: dict = {}
        self.start = self.g.add([])
        self._memo: dict = {}
        W, C = topo.world_size, prof.host_cores
        self.full_share = 1.0 if C is None else min(1.0, C / W)  # compute speed, all busy
        if C is not None:  # folded: the simulated machines' share of the host
            self.caps[("host",)] = C * self.span / W

    def image(self, rank: int) -> int:
        """The simulated rank standing for ``rank`` (itself, unless machines are folded)."""
        return rank % self.span

    def _key(self, src: int, dst: int) -> tuple:
        """Which sends and receives meet: the pair, or folded (GPUs, machine offset)."""
        if not self.fold:
            return (src, dst)
        node = self.topo.node_of
        return (self.image(src), self.image(dst), (node(dst) - node(src)) % self.topo.nodes)

    # -- resources
    def _cpu(self, rank: int) -> tuple:
        return ("host",) if self.p.host_cores is not None else ("cpu", rank)

    def compute(self, rank: int, seconds: float, deps) -> int:
        res = self._cpu(rank) if self.p.host_waits or self.p.host_cores is not None else ("dev", rank)
        return self.g.add(deps, _WORK, seconds, {res: seconds})

    def fanout(self, rank: int, op: Transfer) -> int:
        """Other machines among the peers of ``rank``'s transfer ``op``."""
        node = self.topo.node_of
        return len({node(p) for p, _ in (*op.sends, *op.recvs)} - {node(rank)})

    def message(self, kind: str, src: int, dst: int, nbytes: int, deps, fanout: int | None = None) -> int:
        """Latency, then ``nbytes`` from ``src`` to ``dst`` (real ranks) over their path, at
        the rate of ``kind`` for its locality and the sender's ``fanout`` (``HardwareProfile.rate``)."""
        node = self.topo.node_of
        local = node(src) == node(dst)
        src, dst = self.image(src), self.image(dst)
        rate = self.p.rate(kind, "intra" if local else "inter", fanout)
        d: dict = defaultdict(float)
        if local:
            if math.isfinite(rate.bw):
                d[("out", src)] += nbytes / rate.bw
                d[("in", dst)] += nbytes / rate.bw
        else:
            if math.isfinite(rate.bw):
                d[("up", node(src))] += nbytes / rate.bw
                d[("down", node(dst))] += nbytes / rate.bw
            nic = self.p.inter_gpu_bw
            if nic:
                d[("nic-out", src)] += nbytes / nic
                d[("nic-in", dst)] += nbytes / nic
        if rate.cpu_s_per_byte:
            for r in (src, dst):
                d[self._cpu(r)] += nbytes * rate.cpu_s_per_byte / 2
        lat = self.g.add(deps, _DELAY, rate.latency_s)
        alone = max([v / self.caps.get(r, 1.0) for r, v in d.items() if r != ("host",)]
                    + [d.get(("host",), 0.0)], default=0.0)
        return self.g.add([lat], _WORK, alone, dict(d))

    def _seconds(self, op: Attend | Copy) -> float:
        """Full-speed seconds of a compute op (memoized: ranks repeat the same calls)."""
        t = self._memo.get(op)
        if t is None:
            t = self._memo[op] = (
                self.p.attend_s(self.dtype, self.D, op.bh, op.q, op.kv, op.finalize)
                if isinstance(op, Attend) else op.nbytes / self.p.copy_bw)
        return t

    # -- programs
    def build(self, programs: list[list[Op]], ranks: list[int] | None = None) -> list[int]:
        """Nodes of the simulated ranks' programs (rank ``ranks[i]``, default i:
        ``programs[i]``); the node where each is done (``self.hosts``: where its host is)."""
        g, p = self.g, self.p
        sync = p.host_waits
        ends, self.compute_s, self.hosts = [], [], []
        msgs: dict[tuple, list] = defaultdict(list)  # (pair key, queue, kind) -> its ends
        barriers: dict[tuple, list] = defaultdict(list)  # (ranks, quiet) -> per instance arrivals
        seen_barrier: dict[tuple, int] = defaultdict(int)
        self.transfers: list[tuple] = []  # (rank, op, issue node, completion node)
        for rank, ops in zip(ranks or range(len(programs)), programs):
            host = stream = self.start
            handles: dict[str, int] = {}
            open_: list[int] = []
            fifo: dict[tuple, list[int]] = defaultdict(list)  # queue -> its transfers' ends
            busy = 0.0
            for op in ops:
                if isinstance(op, (Attend, Copy)):
                    secs = self._seconds(op)
                    busy += secs
                    if isinstance(op, Attend) and (p.attend_call_s or p.merge_call_s):
                        host = g.add([host], _DELAY, p.attend_call_s + len(op.q) * p.merge_call_s)
                    stream = self.compute(rank, secs, [host, stream])
                    if sync:
                        host = stream
                elif isinstance(op, Transfer):
                    if p.transfer_call_s:
                        host = g.add([host], _DELAY, p.transfer_call_s)
                    one = op.kind in ("get", "put")
                    queue = fifo[op.queue, one]
                    depth = p.one_sided_depth if one else 1 if p.two_sided_fifo else 0
                    before = queue[-depth] if depth and len(queue) >= depth else None
                    issue = g.add([host, stream, before])
                    done = g.add([])  # completed when its messages are (filled in below)
                    handles[op.handle] = done
                    open_.append(done)
                    queue.append(done)
                    self.transfers.append((rank, op, issue, done))
                    fan = self.fanout(rank, op)
                    if op.kind in ("get", "put"):
                        for peer, n in op.recvs:
                            g.deps[done].append(self.message(op.kind, peer, rank, n, [issue], fan))
                        for peer, n in op.sends:
                            g.deps[done].append(self.message(op.kind, rank, peer, n, [issue], fan))
                    else:
                        for peer, n in op.sends:
                            msgs[self._key(rank, peer), op.queue, op.kind].append(
                                ("send", n, issue, done, rank, peer, fan))
                        for peer, n in op.recvs:
                            msgs[self._key(peer, rank), op.queue, op.kind].append(
                                ("recv", n, issue, done, peer, rank, fan))
                elif isinstance(op, Wait):
                    stream = g.add([stream, *(handles[h] for h in op.handles)])
                    if sync:
                        host = stream if host == stream else g.add([host, stream])
                elif isinstance(op, Barrier):
                    key = (tuple(sorted({self.image(x) for x in op.ranks})), op.quiet)
                    i = seen_barrier[rank, key] = seen_barrier.get((rank, key), -1) + 1
                    arrive = g.add([host, stream, *(open_ if op.quiet else [])])
                    insts = barriers[key]
                    while len(insts) <= i:
                        insts.append(g.add([], _DELAY, p.barrier_s if op.quiet else p.sync_s))
                    g.deps[insts[i]].append(arrive)
                    stream = insts[i]
                    if sync:
                        host = stream
            ends.append(g.add([host, stream, *open_]))
            self.hosts.append(host)
            self.compute_s.append(busy / self.full_share)
        self._match(msgs)
        return ends

    def _match(self, msgs: dict) -> None:
        """Two-sided messages: the n-th send from a to b on a queue meets the n-th receive."""
        g, fifo_pair = self.g, not self.p.two_sided_fifo
        for (_, queue, kind), ends in msgs.items():
            sends = [e for e in ends if e[0] == "send"]
            recvs = [e for e in ends if e[0] == "recv"]
            if len(sends) != len(recvs):
                src, dst = (sends or recvs)[0][4:6]
                raise ValueError(f"{kind} on queue {queue!r}: rank {src} sends {len(sends)} messages "
                                 f"to rank {dst}, which receives {len(recvs)}")
            prev = None
            for (_, n, s_issue, s_done, src, dst, fan), (_, _, r_issue, r_done, *_) in zip(sends, recvs):
                m = self.message(kind, src, dst, n, [s_issue, r_issue, prev if fifo_pair else None],
                                 fan)
                prev = m
                g.deps[s_done].append(m)
                g.deps[r_done].append(m)


def _allocate(active: dict[int, float], demand: list, caps: dict) -> dict[int, float]:
    """Max-min fair speeds (0..1, a fraction of each job's speed alone) by progressive filling."""
    use = {j: {r: v / w for r, v in demand[j].items()} for j, w in active.items()}
    speed: dict[int, float] = {}
    residual = dict.fromkeys((r for u in use.values() for r in u), 0.0)
    for r in residual:
        residual[r] = caps.get(r, 1.0)
    level, unfrozen = 0.0, set(active)
    while unfrozen:
        load: dict = defaultdict(float)
        for j in unfrozen:
            for r, c in use[j].items():
                load[r] += c
        inc = 1.0 - level
        for r, l in load.items():
            if l > 0:
                inc = min(inc, max(residual[r], 0.0) / l)
        level += inc
        full = set()
        for r, l in load.items():
            residual[r] -= inc * l
            if residual[r] <= _EPS * max(caps.get(r, 1.0), 1.0):
                full.add(r)
        done = unfrozen if level >= 1.0 - _EPS else {j for j in unfrozen if full & use[j].keys()}
        for j in done:
            speed[j] = level
        unfrozen -= done
    return speed


def _run(g: _Graph, caps: dict) -> list[float]:
    """Finish time of every node."""
    n = len(g.kind)
    children: list[list[int]] = [[] for _ in range(n)]
    left = [0] * n
    for i, deps in enumerate(g.deps):
        uniq = set(deps)
        left[i] = len(uniq)
        for d in uniq:
            children[d].append(i)
    finish = [math.nan] * n
    now = 0.0
    delays: list[tuple[float, int]] = []
    active: dict[int, float] = {}   # work node -> seconds alone
    remaining: dict[int, float] = {}  # fraction of the work left
    speed: dict[int, float] = {}
    ready = [i for i in range(n) if left[i] == 0]
    dirty = False
    while True:
        while ready:
            i = ready.pop()
            if g.kind[i] == _WORK and g.dur[i] > 0:
                active[i], remaining[i] = g.dur[i], 1.0
                dirty = True
            elif g.kind[i] == _DELAY and g.dur[i] > 0:
                heapq.heappush(delays, (now + g.dur[i], i))
            else:
                finish[i] = now
                for c in children[i]:
                    left[c] -= 1
                    if left[c] == 0:
                        ready.append(c)
        if not active and not delays:
            break
        if dirty:
            speed = _allocate(active, g.demand, caps)
            dirty = False
        t_next = delays[0][0] if delays else math.inf
        ends = {}  # when each job in flight would end at its speed now
        for j, w in active.items():
            s = speed[j]
            if s > 0:
                ends[j] = now + remaining[j] * w / s
                t_next = min(t_next, ends[j])
        if not math.isfinite(t_next):
            raise RuntimeError("timeline stalled: jobs in flight make no progress")
        dt = t_next - now
        now = t_next
        finished = []
        for j, w in active.items():
            remaining[j] -= dt * speed[j] / w
            # by its end time too: late in a long timeline a short job's rest can fall below
            # the clock's resolution (now + rest == now), and it would never end
            if remaining[j] <= 1e-9 or ends.get(j, math.inf) <= t_next:
                finished.append(j)
        for j in finished:
            del active[j], remaining[j]
            dirty = True
        while delays and delays[0][0] <= now + _EPS:
            finished.append(heapq.heappop(delays)[1])
        for i in finished:
            finish[i] = now
            for c in children[i]:
                left[c] -= 1
                if left[c] == 0:
                    ready.append(c)
    if any(math.isnan(finish[i]) for i in range(n)):
        raise RuntimeError("timeline deadlock: some ops never became ready (mismatched messages "
                           "or barriers in the programs)")
    return finish


def machine_period(programs: list[list[Op]], topology: Topology) -> int:
    """The fewest machines k (dividing N) such that rank x + k*M runs rank x's program with
    every peer k machines further on (N: no symmetry, or ranks not node-major)."""
    N = topology.nodes
    if topology.order is not None:
        return N
    return next(k for k in range(1, N + 1) if N % k == 0 and (k == N or _shifts(programs, topology, k)))


def _shifts(programs: list[list[Op]], topology: Topology, k: int) -> bool:
    M, W = k * topology.gpus_per_node, topology.world_size
    # a transfer's pairs as a multiset: only the order of one peer's messages across calls matters
    shift = lambda ps: sorted(((p + M) % W, n) for p, n in ps)  # noqa: E731
    for x in range(W - M):
        a, b = programs[x], programs[x + M]
        if len(a) != len(b):
            return False
        for oa, ob in zip(a, b):
            if isinstance(oa, Transfer):
                if not (isinstance(ob, Transfer) and (oa.kind, oa.queue, oa.handle) == (ob.kind, ob.queue, ob.handle)
                        and shift(oa.sends) == sorted(ob.sends) and shift(oa.recvs) == sorted(ob.recvs)):
                    return False
            elif isinstance(oa, Barrier):
                if not (isinstance(ob, Barrier) and oa.quiet == ob.quiet
                        and {(p + M) % W for p in oa.ranks} == set(ob.ranks)):
                    return False
            elif oa != ob:
                return False
    return True


def simulate(programs: list[list[Op]], topology: Topology, profile: HardwareProfile,
             dtype: str, head_dim: int) -> Result:
    """Run every rank's program (rank i: ``programs[i]``) from time 0 on ``profile``; where the
    timeline repeats every k machines (``machine_period``), the first k machines stand for all."""
    b = _Builder(topology, profile, dtype, head_dim, machine_period(programs, topology))
    ends = b.build(programs[:b.span])
    finish = _run(b.g, b.caps)
    n = len(ends)
    return Result([finish[ends[x % n]] for x in range(topology.world_size)],
                  [b.compute_s[x % n] for x in range(topology.world_size)],
                  [finish[b.hosts[x % n]] for x in range(topology.world_size)])


def simulate_alone(ops: list[Op], rank: int, topology: Topology, profile: HardwareProfile,
                   dtype: str, head_dim: int) -> Result:
    """Rank ``rank``'s program with no other rank there (the GPU suite's replay: one GPU runs
    one rank's layer): its one-sided transfers run on it alone, its barriers end when it
    arrives; a two-sided transfer, which needs its peer, is an error. ``Result``'s lists hold
    that rank only."""
    two = [op.kind for op in ops if isinstance(op, Transfer) and op.kind not in ("get", "put")]
    if two:
        raise ValueError(f"rank {rank}'s program makes two-sided transfers ({', '.join(sorted(set(two)))}): "
                         "they cannot run without their peers")
    b = _Builder(topology, profile, dtype, head_dim)
    (end,) = b.build([ops], [rank])
    finish = _run(b.g, b.caps)
    return Result([finish[end]], b.compute_s, [finish[b.hosts[0]]])


__all__ = ["Result", "simulate", "simulate_alone"]
