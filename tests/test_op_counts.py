"""Host operations per attention call, pinned to formulas in T (machines a Ulysses group spans),
U (its GPUs per machine), R (ring degree) and G = T*U (Ulysses degree).

Counted by ``ctx.stats()`` per call (no text tokens):

- ``tas``: 4 all-to-alls (one grouped exchange each when G > 1) and a ring of R - 1 steps
  (one exchange each, K and V); R attend calls in the ring plus one to finalize.
- ``torus``: the intra-machine scatter of Q, K, V (3 exchanges when U > 1), 3 (T - 1) pulls
  (Q, K, V per stage), T pushes of O (the local one an exchange only when U > 1), and R - 1
  ring steps in each of the 3T - 2 ring passes (T Pull-Q, T - 2 Pull-KV, T - 1 blocks of the
  last Pull-KV, one Push-O; 1 when T = 1); R attends per pass and T finalizations.
- ``swiftfusion``: the same stages as one-sided puts and gets with K and V of a slot packed
  (one get per pulled K/V block and per ring step), no grouped exchange, two global barriers
  and one ring-group sync per Pull-KV stage when R > 1.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.emulation.launcher import run_emulated

# (topology, heads): T, U, R with the TAS rule P_u = gcd(N*M, H)
CASES = {("1x2", 2): (1, 2, 1), ("2x2", 4): (2, 2, 1), ("2x2", 2): (2, 1, 2),
         ("4x1", 4): (4, 1, 1), ("2x4", 4): (2, 2, 2)}


def expected(strategy: str, T: int, U: int, R: int) -> dict:
    G, passes = T * U, 3 * T - 2
    if strategy == "tas":
        return {"transfers": 4 * (G - 1) + 2 * (R - 1), "grouped_exchanges": 4 * (G > 1) + R - 1,
                "barriers": 0, "attend_calls": R + 1}
    attends = R * passes + T
    if strategy == "torus":
        return {"transfers": 4 * (U - 1) + 4 * U * (T - 1) + 2 * (R - 1) * passes,
                "attend_calls": attends, "barriers": 0,
                "grouped_exchanges": 4 * (U > 1) + 4 * (T - 1) + (R - 1) * passes}
    return {"transfers": 4 * (U - 1) + 3 * U * (T - 1) + (R - 1) * passes,
            "attend_calls": attends, "grouped_exchanges": 0, "barriers": 2 + (T - 1) * (R > 1)}


def _counts(heads: int) -> dict:
    """All three contexts open at once, their calls interleaved: each counts only its own."""
    S, D = 8, 8
    x = torch.randn(1, heads, S, D, generator=torch.Generator().manual_seed(dist.get_rank()))
    strategies = ("tas", "torus", "swiftfusion")
    with contextlib.ExitStack() as stack:
        ctxs = [stack.enter_context(sf.init_sequence_parallel(s, heads, timeout_s=60))
                for s in strategies]
        for ctx in ctxs:
            ctx.attention(x, x, x)  # first call: shape check and buffers
            ctx.reset_stats()
        for _ in range(2):
            for ctx in ctxs:
                ctx.attention(x, x, x)
        out = {}
        for strategy, ctx in zip(strategies, ctxs):
            stats, m = ctx.stats(), ctx.mesh
            out[strategy] = ({k: stats[k] / stats["calls"] for k in
                              ("transfers", "grouped_exchanges", "barriers", "attend_calls")},
                             (m.torus, m.ulysses_intra, m.ring))
    return out


@pytest.mark.parametrize("topology,heads", list(CASES))
def test_host_operations_per_call_follow_the_formulas(topology, heads):
    for rank, counts in enumerate(run_emulated(_counts, topology, heads, timeout_s=180)):
        for strategy, (per_call, tur) in counts.items():
            assert tur == CASES[(topology, heads)], (strategy, tur)
            assert per_call == expected(strategy, *tur), (topology, heads, rank, strategy, per_call)


def test_formula_counts_are_not_all_equal():
    """The formulas tell the strategies apart (the test above can fail on a wrong one)."""
    rows = {s: expected(s, 2, 2, 2) for s in ("tas", "torus", "swiftfusion")}
    assert len({tuple(r.values()) for r in rows.values()}) == 3


# --- the order of the one-sided transfers -------------------------------------------------

def _one_sided_peers(heads: int) -> list[tuple[str, int]]:
    """(kind, peer) of every put and get of one swiftfusion call on this rank, in issue order
    (the ring's gets included), as the communicator receives them: the second call, which runs
    the plan the first compiled."""
    from xfuser_swiftfusion.emulation.shm import ShmCommunicator
    x = torch.randn(1, heads, 8, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    seen: list[tuple[str, int]] = []
    prepare = ShmCommunicator.prepare

    def counted(self, op, dst, src, peer, **kw):
        issue = prepare(self, op, dst, src, peer, **kw)
        return lambda: seen.append((op, peer)) or issue()

    ShmCommunicator.prepare = counted
    try:
        with sf.init_sequence_parallel("swiftfusion", heads, timeout_s=60) as ctx:
            ctx.attention(x, x, x)  # first call: buffers and the plan
            seen.clear()
            ctx.attention(x, x, x)
    finally:
        ShmCommunicator.prepare = prepare
    return seen


@pytest.mark.parametrize("topology,heads", [("2x2", 4), ("2x4", 4)])
def test_one_sided_transfers_run_in_the_programs_order_and_never_queue_on_one_gpu(topology, heads):
    """swiftfusion issues its puts and gets to the peers, in the order, of the program the cost
    model times; and at every position of that order the GPUs of one machine address different
    GPUs (``machine_order``), so no GPU serves all of its machine's requests at once."""
    from xfuser_swiftfusion import cost_model
    from xfuser_swiftfusion.mesh import choose_mesh
    from xfuser_swiftfusion.strategies import get
    from xfuser_swiftfusion.strategies.ops import Transfer
    from xfuser_swiftfusion.topology import Topology
    topo = Topology.parse(topology)
    spec = get("swiftfusion")
    mesh = choose_mesh(topo, heads, spec.placement)
    programs = cost_model.programs(spec, mesh, cost_model.Workload(1, 8 * topo.world_size, heads, 8, "fp32"))
    seen = run_emulated(_one_sided_peers, topology, heads, timeout_s=180)
    for rank, ops in enumerate(programs):
        planned = [(op.kind, p) for op in ops if isinstance(op, Transfer) and op.kind in ("get", "put")
                   for p, _ in (op.recvs if op.kind == "get" else op.sends)]
        assert seen[rank] == planned, (rank, seen[rank], planned)
    U = mesh.ulysses_intra
    for machine in range(topo.nodes):
        ranks = [mesh.rank_of(machine, u, 0) for u in range(U)]
        remote = [[p for kind, p in seen[x] if kind == "get" and topo.node_of(p) != machine]
                  for x in ranks]
        for position in zip(*remote):
            assert len(set(position)) == U, (machine, remote)
