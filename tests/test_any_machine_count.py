"""The Torus schedule on any machine count: zero-padded heads where the default mesh
``gcd(N*M, H)`` does not fit the machines (issue 22 item 6).

Mesh level (no cluster): which ``H'`` is chosen, against an independent characterisation
(node-major ranks: a ``tas`` mesh is torus-ready iff N divides gcd(N*M, H'), i.e. N | H');
the cost model predicts the padded run. Strategy level: ``PaddedAttention`` around a
single-device fp64 attention. Cluster level (emulated): ``torus`` and ``swiftfusion`` run as
asked on topologies where they used to fall back to ``tas``, equal to the fp64 reference
(``support.reference``) within 1e-5 in fp32, with and without text, grouped-query K/V and a
key mask; ``pad_heads=False`` runs ``tas`` and says so.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.cost_model import (GPU_PROFILES, Workload, candidates, predict,
                                           recommend)
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.mesh import choose_mesh, counted_inter_node_elements, torus_mesh, torus_padding
from xfuser_swiftfusion.strategies import get
from xfuser_swiftfusion.strategies.layout import Joint, KeyMask
from xfuser_swiftfusion.strategies.padded import PaddedAttention
from xfuser_swiftfusion.topology import Topology
from support.reference import attention, max_abs_err, rank_rows

P4DE = GPU_PROFILES["p4de"]


# --- mesh level ---------------------------------------------------------------------------

@pytest.mark.parametrize("topo,heads,padded,degrees", [
    ("3x8", 40, 42, (6, 4)),     # Wan 14B: U8xR3 -> U6xR4
    ("3x8", 38, 39, (3, 8)),     # SD3.5 Large: U2xR12 -> U3xR8
    ("8x8", 30, 32, (32, 2)),    # CogVideoX 2B
    ("3x2", 4, 6, (6, 1)),
    ("3x2", 10, 12, (6, 1)),
    ("2x2", 3, 4, (4, 1)),
    ("2x2", 1, 2, (2, 2)),
    ("3x4", 8, 9, (3, 4)),
    ("3x2", 1, None, None),      # H' <= 2: none fits 3 machines
    ("4x8", 24, None, None),     # torus-ready already
])
def test_padding_choice(topo, heads, padded, degrees):
    t = Topology.parse(topo)
    assert torus_padding(t, heads) == padded
    mesh, h = torus_mesh(t, heads)
    if padded is None:
        assert h == heads and mesh == choose_mesh(t, heads, "tas")
        return
    assert not choose_mesh(t, heads, "tas").torus_ready
    assert h == padded and (mesh.ulysses, mesh.ring) == degrees
    assert mesh.torus_ready and mesh.torus == t.nodes


def test_padding_is_smallest_multiple_of_machine_count():
    """Independent characterisation over many shapes: H' = the smallest multiple of N above H
    (when the default mesh is not torus-ready and that multiple is at most 2H)."""
    for nodes in (2, 3, 4, 5, 6, 8):
        for gpus in (1, 2, 4, 8):
            t = Topology(nodes, gpus)
            for heads in range(1, 50):
                ready = heads % nodes == 0
                want = None if ready else (heads // nodes + 1) * nodes
                if want is not None and want > 2 * heads:
                    want = None
                assert torus_padding(t, heads) == want, (t, heads)


def test_given_degrees_or_opt_out_are_not_padded():
    t = Topology(3, 2)
    assert torus_mesh(t, 4, pad=False)[1] == 4
    mesh, h = torus_mesh(t, 4, ulysses_degree=2)
    assert h == 4 and (mesh.ulysses, mesh.ring) == (2, 3) and not mesh.torus_ready


def test_cost_model_predicts_the_padded_run():
    t, w = Topology(3, 8), Workload(1, 24 * 512, 40, 128)
    for name in ("torus", "swiftfusion"):
        p = predict(name, t, w, P4DE)
        assert (p.runs_as, p.heads, p.padded, p.ulysses, p.ring) == (name, 42, True, 6, 4)
        # bytes of 42 heads on U6xR4: 4 (N-1)/N of X' = B L H' D / W, bf16
        mesh = choose_mesh(t, 42, "tas")
        ring = "pull" if name == "swiftfusion" else "pass"
        assert p.inter_node_bytes == max(counted_inter_node_elements(mesh, 1, 24 * 512, 42, 128, ring)) * 2
        assert p.inter_node_bytes == 4 * 2 * (24 * 512 * 42 * 128 // 24) // 3 * 2
        off = predict(name, t, w, P4DE, pad_heads=False)
        assert (off.runs_as, off.heads, off.padded) == ("tas", 40, False)
        # the padded run is the 42-head layer's: compute and latency included
        h42 = predict(name, t, Workload(1, 24 * 512, 42, 128), P4DE)
        assert (h42.heads, h42.padded) == (42, False)
        assert (p.compute_s, p.latency_s) == (h42.compute_s, h42.latency_s)
    assert predict("tas", t, w, P4DE).heads == 40
    padded = [c for c in candidates(t, w, P4DE, pad_heads=True) if c.padded]
    assert {c.strategy for c in padded} == {"torus", "swiftfusion"}
    assert not any(c.padded for c in candidates(t, w, P4DE))
    best = recommend(t, w, P4DE, pad_heads=True)
    assert best.latency_s <= recommend(t, w, P4DE).latency_s


def test_plan_shows_padding(capsys):
    from xfuser_swiftfusion.tools.cli import main, plan
    p = plan(3, 8, 40, 24 * 512, 128)
    assert (p["torus"]["runs_as"], p["torus"]["heads"], p["torus"]["ulysses_degree"]) == ("torus", 42, 6)
    assert p["tas"]["heads"] == 40
    assert plan(3, 8, 40, 24 * 512, 128, pad_heads=False)["swiftfusion"]["runs_as"] == "tas"
    assert main(["plan", "--nodes", "3", "--gpus-per-node", "8", "--heads", "40", "--seq-len",
                 "12288", "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert "40->42" in out and "zero-padded heads" in out


# --- strategy level: the wrapper around a single-device attention --------------------------

class _Local:
    """A one-rank "strategy": fp64 reference attention over text + image keys, text rows first
    (the USP contract on one rank). Records the head counts it was called with."""

    spec = get("torus")
    comms: list = []

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, q, k, v, joint, scale, key_mask: KeyMask | None = None):
        self.calls.append((q.shape[1], k.shape[1], key_mask is not None))
        mask = None if key_mask is None else key_mask.tokens
        if joint is not None:
            k, v = torch.cat([joint.k, k], 2), torch.cat([joint.v, v], 2)
            q = torch.cat([joint.q, q], 2)
            if mask is not None:
                mask = torch.cat([torch.ones(mask.shape[0], joint.length, dtype=torch.bool), mask], 1)
        return attention(q, k, v, scale, mask).to(q.dtype)

    def close(self, failed):
        pass


@pytest.mark.parametrize("gqa,text,masked", [(False, False, False), (True, True, False),
                                             (False, True, True), (True, False, True)])
def test_padded_wrapper_exact(gqa, text, masked):
    B, H, Hp, S, D, Tj = 2, 6, 9, 10, 8, 3
    Hkv = 2 if gqa else H
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, S, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    jq = torch.randn(B, H, Tj, D, generator=g)
    jk, jv = (torch.randn(B, Hkv, Tj, D, generator=g) for _ in range(2))
    mask = torch.rand(B, S, generator=g) > 0.4
    mask[0] = False  # batch 0: no image key; with text its rows attend only to text, else 0
    inner = _Local()
    wrapped = PaddedAttention(inner, H, Hp)
    assert wrapped.spec is inner.spec
    joint = Joint(jq, jk, jv, "front") if text else None
    kw = {"key_mask": KeyMask(mask, S)} if masked else {}
    out = wrapped(q, k, v, joint, D ** -0.5, **kw)
    assert inner.calls == [(Hp, Hp, masked)]
    ref = rank_rows(q, k, v, 0, 1, (jq, jk, jv) if text else None, "front",
                    key_mask=mask if masked else None)
    assert out.shape == ref.shape == (B, H, S + (Tj if text else 0), D)
    assert max_abs_err(out, ref) < 1e-6


# --- cluster level -------------------------------------------------------------------------

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _run_cases(cases):
    """On every rank: each case through init_sequence_parallel; returns rows of
    (id, asked, ran, mesh degrees, torus_ready, padded heads, err, inter bytes, log)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = _Records()
    logging.getLogger("xfuser.swiftfusion").addHandler(rec)
    logging.getLogger("xfuser.swiftfusion").setLevel(logging.INFO)
    rows = []
    for c in cases:
        B, H, Hkv, L, D, Tj, where = c["B"], c["H"], c["Hkv"], c["L"], c["D"], c["Tj"], c["where"]
        g = torch.Generator().manual_seed(c["id"])
        q = torch.randn(B, H, L, D, generator=g)
        k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
        jq = torch.randn(B, H, Tj, D, generator=g)
        jk, jv = (torch.randn(B, Hkv, Tj, D, generator=g) for _ in range(2))
        mask = (torch.rand(B, L, generator=g) > 0.3) if c["masked"] else None
        S = L // world
        mine = slice(rank * S, (rank + 1) * S)
        ref = rank_rows(q, k, v, rank, world, (jq, jk, jv) if Tj else None, where, key_mask=mask)
        joint = dict(joint_query=jq, joint_key=jk, joint_value=jv, joint_strategy=where) if Tj else {}
        for name in c["strategies"]:
            rec.messages.clear()
            ctx = sf.init_sequence_parallel(name, H, timeout_s=60, options=c["options"])
            try:
                out = ctx.attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], key_mask=mask, **joint)
                assert out.shape == ref.shape, (out.shape, ref.shape)
                rows.append((c["id"], name, ctx.strategy, (ctx.mesh.ulysses, ctx.mesh.ring),
                             ctx.mesh.torus_ready, getattr(ctx._impl, "padded", H),
                             max_abs_err(out, ref), ctx.stats()["inter_node_bytes"],
                             list(rec.messages)))
            finally:
                ctx.close()
    return rows


def _case(i, H, B=1, Hkv=None, L=None, D=16, Tj=0, where="front", masked=False,
          strategies=("torus", "swiftfusion"), options=None):
    return dict(id=i, B=B, H=H, Hkv=Hkv or H, L=L, D=D, Tj=Tj, where=where, masked=masked,
                strategies=strategies, options=options)


def _check(topo, cases, expect):
    """``expect[id]``: (ran, degrees, padded heads)."""
    N, M = map(int, topo.split("x"))
    for c in cases:
        c["L"] = c["L"] or 4 * N * M
    per_rank = run_emulated(_run_cases, topo, cases, timeout_s=240)
    by_id = {c["id"]: c for c in cases}
    for rank, rows in enumerate(per_rank):
        assert len(rows) == sum(len(c["strategies"]) for c in cases)
        for cid, asked, ran, degrees, ready, padded, err, inter, log in rows:
            c = by_id[cid]
            want_ran, want_degrees, want_padded = expect[cid]
            assert (ran, degrees, padded) == (want_ran or asked, want_degrees, want_padded), (rank, c, asked)
            assert err <= 1e-5, (rank, c, asked, err)
            if want_ran is None:
                assert ready
            if c["Tj"] == 0 and c["Hkv"] == c["H"] and want_ran is None:
                # what moves: 4 (N-1)/N^2 B L H' D / M elements per GPU (fp32), padded heads
                assert inter == 4 * (N - 1) * c["B"] * c["L"] * padded * c["D"] // (N * N * M) * 4
    # rank 0 says once per (strategy, H) what is padded and what it costs
    logs = [m for row in per_rank[0] for m in row[-1]]
    for cid, asked, _, _, _, padded, *_ in per_rank[0]:
        H = by_id[cid]["H"]
        if padded != H:
            assert sum(m.startswith(f"{asked}: padding {H} heads to {padded} so the Torus "
                                    f"schedule runs on {topo} ({padded / H:.3g}x attention "
                                    "compute and inter-machine bytes)") for m in logs) == 1, logs
    assert not any(": padding " in m for row in per_rank[1] for m in row[-1])  # rank 0 only
    return per_rank


def test_torus_runs_padded_on_3x2():
    """3 machines x 2 GPUs: 4 and 10 heads give U2xR3 (ring across machines; tas before)."""
    cases = [_case(0, H=4, B=2), _case(1, H=10, Tj=5, where="rear"), _case(2, H=4, Tj=3),
             _case(3, H=4, Hkv=2, masked=True, Tj=2)]
    _check("3x2", cases, {0: (None, (6, 1), 6), 1: (None, (6, 1), 12), 2: (None, (6, 1), 6),
                          3: (None, (6, 1), 6)})


def test_torus_runs_padded_on_2x2_and_opt_out():
    """2 x 2: 3 heads give U1xR4 (ring across machines): padded to 4 (U4xR1); 1 head to 2
    (U2xR2, the ring inside machines). ``pad_heads=False``: tas, logged."""
    cases = [_case(0, H=3, Tj=4), _case(1, H=1, B=2),
             _case(2, H=3, strategies=("swiftfusion",), options={"pad_heads": False})]
    rows = _check("2x2", cases, {0: (None, (4, 1), 4), 1: (None, (2, 2), 2),
                                 2: ("tas", (1, 4), 3)})
    log = next(r[-1] for r in rows[0] if r[0] == 2)
    assert any("pad_heads=False" in m for m in log) and any("running 'tas' instead" in m for m in log), log
