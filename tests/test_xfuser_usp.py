"""xFuser's own USP on CPU/gloo equals single-device attention (the `usp` baseline).

The reference is ``support.reference``, independent of the code under test: fp64
softmax(Q K^T * scale) V over the whole gathered sequence (plus text tokens), from the same
inputs every rank generates from one seed.
"""
from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from xfuser_swiftfusion.integrations.xfuser import compat as xfuser_compat
from support.reference import attention_lse, max_abs_err, rank_rows, shard

# Apply + import in the parent once: forked ranks inherit the patched, imported xFuser.
xfuser_compat.apply()
import xfuser.model_executor.layers.usp  # noqa: E402,F401

from xfuser_swiftfusion.emulation.launcher import run_emulated  # noqa: E402
from xfuser_swiftfusion.integrations.xfuser import state as xs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
B, S_LOCAL, D, T_TEXT = 2, 6, 16, 7
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
JOINTS = (None, "front", "rear")


# ---------------------------------------------------------------------------------------------
# helpers that run inside the ranks
# ---------------------------------------------------------------------------------------------

def _inputs(world, heads, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    full = [torch.randn(B, heads, S_LOCAL * world, D, generator=g) for _ in range(3)]
    text = [torch.randn(B, heads, T_TEXT, D, generator=g) for _ in range(3)]
    return [t.to(dtype) for t in full], [t.to(dtype) for t in text]


def _one_case(rank, world, heads, joint, dtype, seed):
    (q, k, v), (tq, tk, tv) = _inputs(world, heads, seed, dtype)
    local = [shard(t, rank, world).contiguous() for t in (q, k, v)]
    scale = 1.0 / math.sqrt(D)
    if joint is None:
        out = xs.xfuser_usp(*local)
        ref = rank_rows(q, k, v, rank, world, scale=scale)
        wrong = rank_rows(q, k, v, (rank + 1) % world, world, scale=scale)
    else:
        out = xs.xfuser_usp(*local, joint_query=tq, joint_key=tk, joint_value=tv,
                            joint_strategy=joint)
        ref = rank_rows(q, k, v, rank, world, (tq, tk, tv), joint, scale)
        wrong = rank_rows(q, k, v, rank, world, (tq, tk, tv),
                          "rear" if joint == "front" else "front", scale)
    assert out.dtype == dtype, out.dtype
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    err = max_abs_err(out, ref)
    wrong_err = max_abs_err(out, wrong)
    return err, wrong_err


def _group_info():
    import torch.distributed as dist
    from yunchang.globals import PROCESS_GROUP
    from xfuser.core.distributed import parallel_state as ps
    return {
        "yc_ulysses": sorted(dist.get_process_group_ranks(PROCESS_GROUP.ULYSSES_PG)),
        "yc_ring": sorted(dist.get_process_group_ranks(PROCESS_GROUP.RING_PG)),
        "xf_ulysses_size": ps.get_ulysses_parallel_world_size(),
        "xf_ring_size": ps.get_ring_parallel_world_size(),
        "xf_ulysses_rank": ps.get_ulysses_parallel_rank(),
        "xf_ring_rank": ps.get_ring_parallel_rank(),
        "xf_sp_ranks": list(ps.get_sp_group().ranks),
        "xf_sp_rank": ps.get_sequence_parallel_rank(),
    }


def _zero_lse_error(rank, world, heads):
    """USP's ring with an attention function whose LSE is 0 (yunchang TORCH_MATH's bug)."""
    from xfuser.core.distributed.attention_backend import (
        ATTENTION_FUNCTION_REGISTRY as reg, AttentionBackendType as T)
    good = reg[T.SDPA_FLASH]

    def zero_lse(query, key, value, dropout_p, is_causal, attention_kwargs=None):
        out, lse = good(query, key, value, dropout_p, is_causal, attention_kwargs)
        return out, torch.zeros_like(lse)

    reg[T.SDPA_FLASH] = zero_lse
    try:
        return _one_case(rank, world, heads, None, torch.float32, seed=99)[0]
    finally:
        reg[T.SDPA_FLASH] = good


def _rank_main(cases, negative_control):
    import torch.distributed as dist
    from xfuser.core.distributed.runtime_state import get_runtime_state
    rank, world = dist.get_rank(), dist.get_world_size()
    rotate_before = xs.ring_rotate_method()
    results = []
    for heads, pu, pr, placement in cases:
        xs.init_xfuser_parallel(pu, pr, placement)
        try:
            entry = {"case": (heads, pu, pr, placement), "groups": _group_info(),
                     "backend": get_runtime_state().attention_backend.name, "errors": {}}
            for dtype in (torch.float32, torch.bfloat16):
                for joint in JOINTS:
                    entry["errors"][(str(dtype), joint)] = _one_case(
                        rank, world, heads, joint, dtype, seed=1000 * heads + pu)
            if negative_control and pr > 1:
                entry["zero_lse_error"] = _zero_lse_error(rank, world, heads)
            results.append(entry)
        finally:
            xs.destroy_xfuser_parallel()
    return {"rank": rank, "results": results, "rotate": (rotate_before, xs.ring_rotate_method())}


# ---------------------------------------------------------------------------------------------
# runs (one emulated cluster per topology, cached across the tests that read it)
# ---------------------------------------------------------------------------------------------

def _cases_for(world, head_counts):
    cases = []
    for h in head_counts:
        pu = math.gcd(world, h)           # the Ulysses degree the heads allow
        for placement in ("usp", "tas"):
            cases.append((h, pu, world // pu, placement))
    return cases


TOPOLOGIES = {
    # heads 8 -> U4 R1, 6 -> U2 R2, 3 -> U1 R4 (gcd limits the Ulysses degree)
    "1x4": _cases_for(4, (8, 6, 3)),
    "2x2": _cases_for(4, (8, 6, 3)) + [(8, 2, 2, "usp"), (8, 2, 2, "tas")],
    "4x1": _cases_for(4, (8, 6, 3)),
    # 8 ranks once: heads 12 -> U4 R2, 6 -> U2 R4
    "2x4": _cases_for(8, (12, 6)),
}


@functools.lru_cache(maxsize=None)
def _run(topology):
    out = run_emulated(_rank_main, topology, TOPOLOGIES[topology], topology == "2x2",
                       timeout_s=240)
    assert [o["rank"] for o in out] == list(range(len(out)))
    return out


def _expected(rank, pu, pr, placement):
    """Independent statement of the placements (node-major ranks)."""
    w = pu * pr
    if placement == "usp":   # Ulysses = contiguous blocks of P_u, Ring = stride P_u
        uly = [x for x in range(w) if x // pu == rank // pu]
        ring = [x for x in range(w) if x % pu == rank % pu]
    else:                    # tas: Ring = contiguous blocks of P_r, Ulysses = stride P_r
        ring = [x for x in range(w) if x // pr == rank // pr]
        uly = [x for x in range(w) if x % pr == rank % pr]
    return uly, ring


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_usp_matches_single_device_attention(topology):
    failures = []
    n_checked = 0
    for o in _run(topology):
        for entry in o["results"]:
            assert entry["backend"] == "SDPA_FLASH"
            for (dtype, joint), (err, wrong_err) in entry["errors"].items():
                tol = TOL[torch.float32] if "float32" in dtype else TOL[torch.bfloat16]
                n_checked += 1
                if not err <= tol:
                    failures.append(f"rank {o['rank']} case {entry['case']} {dtype} "
                                    f"joint={joint}: max err {err:.3g} > {tol}")
                # the comparison discriminates: the neighbour's rows / swapped text order differ
                assert wrong_err > 10 * tol, (entry["case"], dtype, joint, wrong_err)
    assert n_checked == len(TOPOLOGIES[topology]) * 6 * len(_run(topology))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_yunchang_and_xfuser_groups_agree(topology):
    for o in _run(topology):
        rank = o["rank"]
        for entry in o["results"]:
            heads, pu, pr, placement = entry["case"]
            g = entry["groups"]
            uly, ring = _expected(rank, pu, pr, placement)
            assert g["yc_ulysses"] == uly, (placement, rank, g)
            assert g["yc_ring"] == ring, (placement, rank, g)
            assert (g["xf_ulysses_size"], g["xf_ring_size"]) == (pu, pr) == (len(uly), len(ring))
            assert g["xf_ulysses_rank"] == uly.index(rank)
            assert g["xf_ring_rank"] == ring.index(rank)
            assert g["xf_sp_ranks"] == list(range(pu * pr)) and g["xf_sp_rank"] == rank


def test_usp_placement_groups_are_literal_2x4():
    """Spot values for 8 ranks, U4 x R2 (heads 12), against hand-written groups."""
    by_rank = {o["rank"]: {e["case"]: e["groups"] for e in o["results"]} for o in _run("2x4")}
    usp, tas = by_rank[5][(12, 4, 2, "usp")], by_rank[5][(12, 4, 2, "tas")]
    assert (usp["yc_ulysses"], usp["yc_ring"]) == ([4, 5, 6, 7], [1, 5])
    assert (tas["yc_ulysses"], tas["yc_ring"]) == ([1, 3, 5, 7], [4, 5])


def test_ring_merge_needs_the_real_lse():
    """With LSE = 0 (yunchang TORCH_MATH's behaviour) USP's ring is wrong: the check can fail."""
    seen = 0
    for o in _run("2x2"):
        for entry in o["results"]:
            if "zero_lse_error" in entry:
                seen += 1
                assert entry["zero_lse_error"] > 1e-2, entry
    assert seen > 0


def test_ring_rotate_method_is_torch_default_allgather():
    """xFuser leaves torch's rotation alone: the ring all-gathers K/V (not a true ring)."""
    for topo in ("2x2",):
        for o in _run(topo):
            assert o["rotate"] == ("allgather", "allgather")


def test_reinit_in_one_process():
    """usp then tas (and other degrees) were initialised one after another on the same ranks."""
    placements = [e["case"][3] for e in _run("2x2")[0]["results"]]
    assert placements[:2] == ["usp", "tas"] and len(placements) == len(TOPOLOGIES["2x2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_attention_backend_returns_lse(dtype):
    from xfuser.core.distributed.attention_backend import (
        ATTENTION_FUNCTION_REGISTRY as reg, AttentionBackendType as T)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 9, 32, generator=g).to(dtype)
    k = torch.randn(2, 3, 13, 32, generator=g).to(dtype)
    v = torch.randn(2, 3, 13, 32, generator=g).to(dtype)
    out, lse = reg[T.SDPA_FLASH](q, k, v, dropout_p=0.0, is_causal=False)
    ref_out, ref_lse = attention_lse(q, k, v, 1 / math.sqrt(32))
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert lse.dtype == lse_dtype and lse.shape == (2, 3, 9)
    assert out.dtype == dtype and out.shape == (2, 3, 9, 32)
    tol = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=0)
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)


def test_runtime_state_selects_lse_backend_on_cpu():
    from xfuser.core.distributed.runtime_state import RuntimeState
    from xfuser.core.distributed.attention_backend import AttentionBackendType as T
    assert RuntimeState._select_attention_backend(None, None) == T.SDPA_FLASH


def _python(*parts: str) -> subprocess.Popen:
    code = "".join(textwrap.dedent(part) for part in parts)
    # the .pth autoloader would apply the compatibility layer before these checks can see
    # a bare `import xfuser` fail on CPU; tests/ on the path for ``support``
    env = dict(os.environ, SWIFTFUSION_AUTOLOAD="0", PYTHONPATH=os.pathsep.join(
        [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", code], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


_CHECKS = """
    import sys, xfuser, xfuser.envs as envs
    from xfuser_swiftfusion.integrations.xfuser import compat as c
    assert c.is_applied()
    assert sum(type(f).__name__ == "ImportHookFinder" for f in sys.meta_path) == 1
    f = envs.get_device_version
    assert f.__wrapped__ is not None and not hasattr(f.__wrapped__, "__wrapped__")
    assert envs.get_torch_distributed_backend() == "gloo" and envs.CUDA_VERSION is not None
    from xfuser.core.distributed import parallel_state, group_coordinator
    import xfuser.config.config as cfg, xfuser.model_executor.layers.attention_processor as ap
    assert parallel_state.HAS_LONG_CTX_ATTN and group_coordinator.HAS_LONG_CTX_ATTN
    assert cfg.HAS_LONG_CTX_ATTN and ap.HAS_LONG_CTX_ATTN
    from xfuser.model_executor.layers import usp
    from yunchang.globals import PROCESS_GROUP
    assert usp.PROCESS_GROUP is PROCESS_GROUP
    import xfuser.model_executor.models.transformers.transformer_flux as tf   # lazy model code
    assert tf.HAS_LONG_CTX_ATTN
    from yunchang.ring import utils
    assert callable(utils.update_npu_out)
    print("OK")
"""


def test_import_xfuser_on_cpu_after_apply():
    # (a) the usual order: apply() first, then import xfuser; apply() twice is harmless
    #     Ranks are forked before the parent imports xfuser: each rank imports it itself.
    first = _python("""
        import sys, torch
        from xfuser_swiftfusion.integrations.xfuser import compat as xfuser_compat
        xfuser_compat.apply(); xfuser_compat.apply()
        from xfuser_swiftfusion.emulation.launcher import run_emulated

        def rank_fn():
            import torch.distributed as dist
            from support.reference import max_abs_err, rank_rows
            from xfuser_swiftfusion.integrations.xfuser import state as xs
            xfuser_compat.apply()
            xs.init_xfuser_parallel(1, 2, "tas")
            try:
                r = dist.get_rank()
                q, k, v = (torch.randn(1, 2, 8, 8, generator=torch.Generator().manual_seed(i))
                           for i in range(3))
                o = xs.xfuser_usp(*(t[:, :, 4 * r:4 * r + 4].contiguous() for t in (q, k, v)))
                return max_abs_err(o, rank_rows(q, k, v, r, 2))
            finally:
                xs.destroy_xfuser_parallel()

        assert "xfuser" not in sys.modules
        errs = run_emulated(rank_fn, "1x2", timeout_s=150)
        assert max(errs) < 1e-5, errs
        assert "xfuser" not in sys.modules
    """, _CHECKS)
    # (b) a failed `import xfuser` first (proves the patches are needed), then apply() patches
    #     the half-imported modules in place and the import succeeds
    second = _python("""
        try:
            import xfuser
        except NotImplementedError as exc:
            assert "No Accelerators" in str(exc)
        else:
            raise AssertionError("import xfuser unexpectedly works on CPU without apply()")
        from xfuser_swiftfusion.integrations.xfuser import compat as xfuser_compat
        xfuser_compat.apply()
        xfuser_compat.apply()
    """, _CHECKS)
    for name, p in (("apply-then-import", first), ("failed-import-then-apply", second)):
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0 and out.strip().endswith("OK"), f"{name}:\n{out}\n{err[-4000:]}"


def test_apply_is_noop_with_cuda():
    p = _python("""
        import sys, torch
        torch.cuda.is_available = lambda: True
        from xfuser_swiftfusion.integrations.xfuser import compat as xfuser_compat
        xfuser_compat.apply()
        assert not xfuser_compat.is_applied()
        assert not any(type(f).__name__ == "ImportHookFinder" for f in sys.meta_path)
        assert not any(m.startswith(("xfuser.", "yunchang")) for m in sys.modules)
        print("OK")
    """)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip().endswith("OK"), out + err[-3000:]
