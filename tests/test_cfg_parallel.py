"""CFG parallelism with our strategies: two SP groups (one per CFG half) on 8 emulated ranks.

xFuser's rank order ``tp-sp-pp-cfg-dp`` makes the SP groups ``[0, 4)`` and ``[4, 8)``: on
topology 4x2 each SP group is 2 machines x 2 GPUs, on 2x4 one machine (T = 1). References are
independent of the code under test: the fp64 attention of ``support.reference`` and the
single-process diffusers ``FluxTransformer2DModel`` on the whole CFG batch, each combined as
``uncond + s * (cond - uncond)``.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion  # noqa: F401  (CPU compatibility layer)
from xfuser_swiftfusion.integrations import xfuser as xp

xp.install()
import xfuser  # noqa: E402,F401  (forked ranks inherit it)

from xfuser_swiftfusion.comm import CommTimeout, make_one_sided  # noqa: E402
from xfuser_swiftfusion.context import init_sequence_parallel  # noqa: E402
from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.groups import build_groups, global_mesh_tensor  # noqa: E402
from xfuser_swiftfusion.integrations.xfuser import state as xs  # noqa: E402
from xfuser_swiftfusion.integrations.xfuser.routing import use_strategy  # noqa: E402
from xfuser_swiftfusion.mesh import choose_mesh  # noqa: E402
from xfuser_swiftfusion.topology import Topology, TopologyError, subset_topology  # noqa: E402
from support.reference import rank_rows  # noqa: E402

STRATEGIES = ("tas", "torus", "swiftfusion", "auto", "usp")
GUIDANCE = 3.5
# topology -> SP group topology; (SP group topology, placement) -> mesh of U2xR2 on it
SP_TOPOLOGY = {"4x2": "2x2", "2x4": "1x4"}
MESH = {("2x2", "tas"): "U2xR2 (torus 2 x intra-Ulysses 1)",   # Ulysses across 2 machines
        ("2x2", "usp"): "U2xR2 (torus 1 x intra-Ulysses 2)",   # Ulysses inside a machine
        ("1x4", "tas"): "U2xR2 (torus 1 x intra-Ulysses 2)",   # one machine: T = 1
        ("1x4", "usp"): "U2xR2 (torus 1 x intra-Ulysses 2)"}


def _mesh(sp_topology: str, strategy: str) -> str:
    return MESH[sp_topology, "usp" if strategy == "usp" else "tas"]


def _cfg(uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
    return uncond + GUIDANCE * (cond - uncond)


# ---------------------------------------------------------------------------------------------
# the SP group's machines, its mesh over SP ranks, xFuser's groups
# ---------------------------------------------------------------------------------------------

def test_sp_group_topology():
    assert [str(subset_topology(Topology(4, 2), g)) for g in xs.cfg_sp_groups(8, 2)] == ["2x2"] * 2
    assert [str(subset_topology(Topology(2, 4), g)) for g in xs.cfg_sp_groups(8, 2)] == ["1x4"] * 2
    assert str(subset_topology(Topology(1, 6), [0, 1, 2])) == "1x3"
    with pytest.raises(TopologyError, match="does not span whole machines evenly"):
        subset_topology(Topology(3, 4), range(6))        # 4 + 2 ranks
    with pytest.raises(TopologyError, match="distinct ranks"):
        subset_topology(Topology(2, 2), [0, 0])


def test_cfg_sp_groups_are_xfusers_and_the_mesh_maps_into_them():
    assert xs.cfg_sp_groups(8, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert xs.cfg_sp_groups(4, 1) == [(0, 1, 2, 3)]
    mesh = choose_mesh(Topology(2, 2), 6, "tas")        # SP ranks: ring (0, 1), (2, 3)
    groups = build_groups(mesh, 1, "cpu", members=(4, 5, 6, 7), sp_groups=xs.cfg_sp_groups(8, 2))
    assert groups.ring_ranks == (0, 1) and groups.ulysses_ranks == (1, 3)   # SP ranks
    assert groups.global_rank == 5 and [groups.to_global(x) for x in groups.ulysses_ranks] == [5, 7]
    # [C, T, U, R]: every SP group's GPU (t, u, r) as a global rank
    assert global_mesh_tensor(mesh, groups.all_sp_groups).tolist() == [
        [[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]]


# ---------------------------------------------------------------------------------------------
# attention: every strategy on each CFG half equals the single-device CFG result
# ---------------------------------------------------------------------------------------------

def _rank_cfg_attention(topology: str):
    torch.set_num_threads(1)
    W, rank = dist.get_world_size(), dist.get_rank()
    half, S, H, D, Tj = W // 2, 3, 6, 8, 2
    c = rank // half                                     # CFG half: 0 uncond, 1 cond
    members = list(range(c * half, (c + 1) * half))
    pairs = [dist.new_group([j, j + half]) for j in range(half)]   # every rank creates each
    pair = pairs[rank % half]

    def inputs(seed):  # the whole sequence of one half: [1, H, half * S, D], text [1, H, Tj, D]
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(1, H, n, D, generator=g) for n in (half * S,) * 3 + (Tj,) * 3]

    halves = [inputs(10), inputs(20)]
    res = {}
    for strategy in STRATEGIES:
        options = {"external": False} if strategy == "auto" else None
        ctx = init_sequence_parallel(strategy, H, ranks=members, timeout_s=60, options=options)
        try:
            q, k, v, jq, jk, jv = halves[c]
            i = ctx.rank
            local = [t[:, :, i * S:(i + 1) * S].contiguous() for t in (q, k, v)]
            out = ctx.attention(*local, joint_query=jq, joint_key=jk, joint_value=jv,
                                joint_strategy="front")           # [1, H, Tj + S, D]
            both = [torch.empty_like(out) for _ in range(2)]
            dist.all_gather(both, out.contiguous(), group=pair)   # [uncond, cond] of SP rank i
            ref = [rank_rows(*h[:3], i, half, joint=tuple(h[3:])) for h in halves]
            stats = ctx.stats()
            res[strategy] = dict(
                err=(_cfg(*(b.double() for b in both)) - _cfg(*ref)).abs().max().item(),
                half_err=(out.double() - ref[c]).abs().max().item(),
                topology=str(ctx.topology), mesh=ctx.mesh.describe(), sp_rank=i,
                runs=ctx._impl.spec.name, inter=stats["inter_node_bytes"],
                intra=stats["intra_node_bytes"])
        finally:
            ctx.close()
    return res


@pytest.mark.parametrize("topology", ["4x2", "2x4"])
def test_cfg_attention_every_strategy(topology):
    results = run_emulated(_rank_cfg_attention, topology, topology, timeout_s=180)
    sp_topo = SP_TOPOLOGY[topology]
    for rank, res in enumerate(results):
        for strategy in STRATEGIES:
            r = res[strategy]
            assert r["err"] < 1e-5 and r["half_err"] < 1e-5, (rank, strategy, r)
            assert (r["topology"], r["sp_rank"]) == (sp_topo, rank % 4), (rank, strategy, r)
            assert r["mesh"] == _mesh(sp_topo, strategy), (rank, strategy, r)
            assert r["runs"] == strategy, (rank, strategy, r)
            if strategy in ("tas", "torus", "swiftfusion"):
                # 2x4: each SP group is one machine, nothing crosses machines; 4x2: it spans two
                assert (r["inter"] > 0) == (topology == "4x2") and r["intra"] > 0, (rank, r)


# ---------------------------------------------------------------------------------------------
# the one-sided communicator shared by the SP groups
# ---------------------------------------------------------------------------------------------

def _rank_one_sided_view():
    torch.set_num_threads(1)
    rank, W = dist.get_rank(), dist.get_world_size()
    groups = [(0, 1), (2, 3)]
    members = groups[rank // 2]
    one = make_one_sided("shm", rank=rank, world_size=W, node_of=[0, 0, 1, 1], timeout_s=3,
                         members=members, sp_groups=groups)
    res = {"rank": one.rank, "world": one.world_size, "node_of": one.node_of}
    buf = one.symmetric_empty((2,), torch.int64)
    buf.fill_(-1)
    one.barrier_all(what="test: init")
    src = torch.tensor([rank, one.rank])
    one.put(buf, src, 1 - one.rank, queue="other", what="test: put to my SP peer").wait()
    one.barrier_all(what="test: after put")
    res["got"] = buf.tolist()                       # my SP peer's (global rank, SP rank)
    try:
        one.symmetric_empty((2 + rank // 2,), torch.float32)   # the groups ask differently
        res["mismatch"] = "allocated"
    except ValueError as exc:
        res["mismatch"] = str(exc)
    one.barrier_all(what="test: close")
    one.close()
    return res


def test_one_sided_view_addresses_its_sp_group():
    for rank, res in enumerate(run_emulated(_rank_one_sided_view, "2x2", timeout_s=60)):
        peer = rank ^ 1
        assert (res["rank"], res["world"], res["node_of"]) == (rank % 2, 2, [rank // 2] * 2), res
        assert res["got"] == [peer, peer % 2], res
        assert "the SP groups disagree" in res["mismatch"], res
        assert "SP group [0, 1] asks (2,)" in res["mismatch"] and "(3,)" in res["mismatch"], res


def _rank_late_group():
    rank = dist.get_rank()
    one = make_one_sided("shm", rank=rank, world_size=4, node_of=[0, 0, 1, 1], timeout_s=2,
                         members=(0, 1) if rank < 2 else (2, 3), sp_groups=[(0, 1), (2, 3)])
    if rank >= 2:
        time.sleep(4)             # this SP group makes no call: the other must not hang
        return "skipped"
    try:
        one.symmetric_empty((4,), torch.float32)
        return "allocated"
    except CommTimeout as exc:
        return str(exc)


def test_allocation_without_the_other_group_times_out():
    results = run_emulated(_rank_late_group, "2x2", timeout_s=60)
    for rank in (0, 1):
        assert "symmetric allocation 0 (4,) torch.float32" in results[rank], results
        assert "did not join within 2.0 s" in results[rank], results


# ---------------------------------------------------------------------------------------------
# a whole model: xFuser's Flux wrapper splits the CFG batch over the halves (use_cfg_parallel)
# ---------------------------------------------------------------------------------------------

FLUX_CFG = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                attention_head_dim=8, num_attention_heads=24, joint_attention_dim=32,
                pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(2, 2, 4))


def _flux_cfg_inputs(img_tokens=16, text_tokens=8):
    """Batch 2 = (uncond, cond): different image and text states, one pooled projection."""
    g = torch.Generator().manual_seed(3)
    i = torch.arange(img_tokens, dtype=torch.float32)
    return dict(hidden_states=torch.randn(2, img_tokens, 16, generator=g),
                encoder_hidden_states=torch.randn(2, text_tokens, 32, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g),
                timestep=torch.tensor([0.5, 0.5]),
                img_ids=torch.stack([torch.zeros_like(i), i // 4, i % 4], -1),
                txt_ids=torch.zeros(text_tokens, 3))


def _flux_modules():
    from diffusers import FluxTransformer2DModel
    from xfuser.model_executor.models.transformers import transformer_flux
    return FluxTransformer2DModel, transformer_flux


def _rank_cfg_flux(topology: str):
    torch.set_num_threads(1)
    FluxTransformer2DModel, xf_flux = _flux_modules()
    from xfuser.core.distributed import get_runtime_state
    from xfuser.core.distributed import parallel_state as ps
    torch.manual_seed(0)
    ref = FluxTransformer2DModel(**FLUX_CFG).eval()
    par = xf_flux.xFuserFlux1Transformer2DWrapper(**FLUX_CFG).eval()
    par.load_state_dict(ref.state_dict())
    inputs = _flux_cfg_inputs()
    with torch.no_grad():
        pooled = inputs["pooled_projections"].expand(2, -1)
        want = ref(**dict(inputs, pooled_projections=pooled)).sample.double()   # [2, L, C]
    res = {}
    for strategy in STRATEGIES:
        ctx = use_strategy(strategy, 24, topology, ulysses_degree=2, ring_degree=2, cfg_degree=2)
        try:
            get_runtime_state().max_condition_sequence_length = 8
            with torch.no_grad():
                got = par(**inputs).sample.double()   # each half's rows, gathered over CFG
            res[strategy] = dict(
                err=((_cfg(got[0], got[1]) - _cfg(want[0], want[1])).abs().max()
                     / _cfg(want[0], want[1]).abs().max()).item(),
                cfg=(ps.get_classifier_free_guidance_world_size(),
                     ps.get_classifier_free_guidance_rank()),
                sp=sorted(ps.get_sp_group().ranks), topology=str(ctx.topology),
                mesh=ctx.mesh.describe(), calls=ctx.stats()["calls"],
                fallbacks=ctx.stats()["fallbacks"])
        finally:
            xp.restore_usp()
        res[strategy]["torn_down"] = not xs.xfuser_parallel_initialized()
    return res


@pytest.mark.parametrize("topology", ["4x2", "2x4"])
def test_cfg_flux_under_xfuser_every_strategy(topology):
    _flux_modules()  # imported once here: the forked ranks inherit the modules
    results = run_emulated(_rank_cfg_flux, topology, topology, timeout_s=240)
    layers = FLUX_CFG["num_layers"] + FLUX_CFG["num_single_layers"]
    for rank, res in enumerate(results):
        for strategy in STRATEGIES:
            r = res[strategy]
            # whole model (2 layers, fp32): relative to the output's max, as the other model tests
            assert r["err"] < 1e-4, (rank, strategy, r)
            assert r["cfg"] == (2, rank // 4) and r["sp"] == list(range(rank // 4 * 4, rank // 4 * 4 + 4))
            sp_topo = SP_TOPOLOGY[topology]
            assert (r["topology"], r["mesh"]) == (sp_topo, _mesh(sp_topo, strategy)), (rank, r)
            assert r["calls"] == layers and r["fallbacks"] == {}, (rank, strategy, r)
            assert r["torn_down"], (rank, strategy, r)
