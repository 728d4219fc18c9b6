"""Two-sided strategies post every exchange as one grouped operation, ring traffic on its own group.

On NCCL a send to and a receive from one peer issued as separate ``isend``/``irecv`` calls
share one communicator and stream and block until matched: two ranks that both post the receive
first deadlock. gloo (CPU) does not block there, so correctness tests cannot see it; this test
records the point-to-point calls instead. In every forked rank, ``torch.distributed``'s
``isend``/``irecv``/``send``/``recv``/``batch_isend_irecv`` (both the package names and the
``distributed_c10d`` ones) and the posts ``P2PCommunicator.prepare_exchange`` returns are
wrapped; the parent asserts:

- no point-to-point call outside ``batch_isend_irecv``;
- every exchange with a peer other than myself is exactly one batch holding exactly its sends
  and receives, so a peer that appears in both directions appears in both within the batch;
- ring steps (``queue="ring"``) and all other exchanges (``queue="other"``) each use one
  process group, and the two differ.

Meshes cover a 2-rank ring (R = 2), a 2-machine Torus stage (T = 2), Ulysses all-to-alls
within and across machines, and a 4-rank ring.
"""
from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.comm import p2p
from xfuser_swiftfusion.emulation.launcher import run_emulated

P2P_CALLS = ("isend", "irecv", "send", "recv")
SENDS = ("isend", "send")


def _group_name(group: Any) -> str:
    return "default" if group is None else str(group.group_name)


def _install_recorder() -> dict:
    """Wrap the point-to-point API of this (forked) rank; return the log it fills.

    ``log["bare"]``: ``(name, what)`` of p2p calls made outside ``batch_isend_irecv``;
    ``log["exchanges"]``: ``{what, queue, sends, recvs, batches}`` per exchange, ``sends`` and
    ``recvs`` the peers other than me, ``batches`` the batches posted meanwhile, each a list of
    ``(kind, peer, group name)``.
    """
    log: dict = {"bare": [], "exchanges": [], "outside": []}
    state: dict = {"in_batch": 0, "exchange": None}

    def p2p_wrapper(name: str, orig):
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            if not state["in_batch"]:
                ex = state["exchange"]
                log["bare"].append((name, ex["what"] if ex else None))
            return orig(*args, **kwargs)
        return wrapper

    def batch_wrapper(orig):
        @functools.wraps(orig)
        def wrapper(p2p_op_list):
            ops = [("isend" if op.op.__name__ in SENDS else "irecv", int(op.peer), _group_name(op.group))
                   for op in p2p_op_list]
            ex = state["exchange"]
            (ex["batches"] if ex else log["outside"]).append(ops)
            state["in_batch"] += 1
            try:
                return orig(p2p_op_list)
            finally:
                state["in_batch"] -= 1
        return wrapper

    for name in P2P_CALLS:
        w = p2p_wrapper(name, getattr(c10d, name))
        setattr(c10d, name, w)
        setattr(dist, name, w)
    w = batch_wrapper(c10d.batch_isend_irecv)
    c10d.batch_isend_irecv = dist.batch_isend_irecv = w

    cls = p2p.P2PCommunicator
    orig_prepare = cls.prepare_exchange

    def prepare_exchange(self, sends, recvs, *, what, **kw):
        """The exchange as the plan posts it: its batches are what its post issues."""
        post = orig_prepare(self, sends, recvs, what=what, **kw)
        peers = (sorted(p for _, p in sends if p != self.rank), sorted(p for _, p in recvs if p != self.rank))

        def recorded():
            ex = {"what": what, "queue": kw.get("queue"), "batches": [], "sends": peers[0],
                  "recvs": peers[1]}
            outer, state["exchange"] = state["exchange"], ex
            try:
                return post()
            finally:
                state["exchange"] = outer
                log["exchanges"].append(ex)

        return recorded

    cls.prepare_exchange = prepare_exchange
    return log


def _run_cases(cases: list[tuple[str, int]]) -> list[dict]:
    """On every rank: one attention call per ``(strategy, heads)``; its mesh and records."""
    rank = dist.get_rank()
    log = _install_recorder()
    out = []
    for strategy, H in cases:
        B, S, D = 1, 4, 8
        g = torch.Generator().manual_seed(1000 * rank + H)
        q, k, v = (torch.randn(B, H, S, D, generator=g) for _ in range(3))
        ctx = sf.init_sequence_parallel(strategy, H, timeout_s=60)
        try:
            start = {key: len(log[key]) for key in log}
            o = ctx.attention(q, k, v)
            m = ctx.mesh
            out.append({"case": (strategy, H), "ran_as": ctx.strategy, "shape": tuple(o.shape),
                        "mesh": {"T": m.torus, "U": m.ulysses_intra, "R": m.ring},
                        **{key: log[key][start[key]:] for key in log}})
        finally:
            ctx.close()
    return out


def check(per_rank: list[list[dict]]) -> tuple[dict, dict]:
    """Assert the grouping rules on every rank's records. Returns, per case, the mesh and the
    stages (``what``) of exchanges that sent to and received from one peer."""
    failures: list[str] = []
    meshes: dict[tuple[str, int], dict] = {}
    paired: dict[tuple[str, int], set[str]] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            case = row["case"]
            meshes[case] = {"ran_as": row["ran_as"], **row["mesh"]}
            where = f"rank {rank} {case[0]} H={case[1]}"
            if row["bare"]:
                failures.append(f"{where}: p2p calls outside batch_isend_irecv: {row['bare'][:4]}")
            if row["outside"]:
                failures.append(f"{where}: batches outside an exchange: {row['outside'][:2]}")
            groups: dict[str, set[str]] = {"ring": set(), "other": set()}
            for ex in row["exchanges"]:
                what, batches = ex["what"], ex["batches"]
                ring_step = "ring step" in what
                if ex["queue"] != ("ring" if ring_step else "other"):
                    failures.append(f"{where}: {what!r} on queue {ex['queue']!r}")
                if not ex["sends"] and not ex["recvs"]:
                    continue
                if len(batches) != 1:
                    failures.append(f"{where}: {what!r} posted {len(batches)} batches, not 1")
                    continue
                (batch,) = batches
                posted = Counter((kind, peer) for kind, peer, _ in batch)
                wanted = Counter([("isend", p) for p in ex["sends"]] + [("irecv", p) for p in ex["recvs"]])
                if posted != wanted:
                    failures.append(f"{where}: {what!r} batch {sorted(posted.elements())} differs "
                                    f"from its sends/receives {sorted(wanted.elements())}")
                both = set(ex["sends"]) & set(ex["recvs"])
                if both:
                    paired.setdefault(case, set()).add(what)
                for p in both:
                    if not {("isend", p), ("irecv", p)} <= set(posted):
                        failures.append(f"{where}: {what!r} splits send/receive with rank {p}")
                groups["ring" if ring_step else "other"].update(gname for *_, gname in batch)
            for q, names in groups.items():
                if len(names) > 1:
                    failures.append(f"{where}: queue {q} traffic on several groups {sorted(names)}")
            if groups["ring"] & groups["other"]:
                failures.append(f"{where}: ring and other traffic share group(s) "
                                f"{sorted(groups['ring'] & groups['other'])}")
            R = row["mesh"]["R"]
            if R > 1 and not groups["ring"]:
                failures.append(f"{where}: R = {R} but no ring exchange was posted")
            if row["ran_as"] != case[0] or row["shape"] != (1, case[1], 4, 8):
                failures.append(f"{where}: ran as {row['ran_as']}, output {row['shape']}")
    assert not failures, "\n".join(failures[:40])
    return meshes, paired


# (topology, [(strategy, heads)]): heads set the mesh (Ulysses degree gcd(world, H)).
TOPOLOGIES = {
    # tas: all-to-all across machines + 2-rank ring; torus: T=2 U=1 R=2, then T=2 U=2 R=1
    "2x2": [("tas", 2), ("torus", 2), ("torus", 4)],
    # one machine: 2-rank ring alone, all-to-all alone; torus T=1 U=2
    "1x2": [("tas", 1), ("tas", 2), ("torus", 2)],
    # two machines of one GPU: all-to-all across machines; torus T=2 U=1 R=1
    "2x1": [("tas", 2), ("torus", 2)],
    # tas: 4-rank ring; torus T=2 U=2 R=2
    "2x4": [("tas", 2), ("torus", 4)],
}


@pytest.mark.parametrize("topo", sorted(TOPOLOGIES))
def test_exchanges_are_grouped_and_ring_has_its_own_group(topo):
    cases = TOPOLOGIES[topo]
    per_rank = run_emulated(_run_cases, topo, cases, timeout_s=300)
    meshes, paired = check(per_rank)
    if topo == "2x2":  # a 2-rank ring and a 2-machine Torus stage: deadlocks when ungrouped
        assert meshes[("tas", 2)]["R"] == 2 and meshes[("torus", 2)] == {
            "ran_as": "torus", "T": 2, "U": 1, "R": 2}, meshes
        tas, torus = paired[("tas", 2)], paired[("torus", 2)]
        assert any("ring step" in w for w in tas) and "Ulysses all-to-all Q" in tas, tas
        for stage in ("Pull-Q stage 2 Q", "Pull-KV stage 1 K", "Push-O to machine", "ring step"):
            assert any(stage in w for w in torus), (stage, torus)
