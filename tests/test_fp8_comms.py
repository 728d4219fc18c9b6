"""FP8 communication (option ``fp8_comms``) of tas, torus and swiftfusion on emulated clusters.

What crosses machines travels as float8_e4m3fn with one fp32 scale per (slot, tensor)
(``strategies/fp8.py``); everything else stays in the compute dtype. Pinned here:

- bytes: inter-machine bytes are exactly half of the bf16 run's plus 4 bytes of scale per
  (inter-machine transfer, tensor): 4 U (T-1) scales per call for every strategy (Q, K, V in
  and O out, U GPUs on each of the T-1 other machines); intra-machine bytes, transfers,
  grouped exchanges and barriers are unchanged;
- accuracy against the fp64 reference (bf16 inputs): the max abs error stays within
  ``FP8_BOUND`` of the reference's largest output magnitude (measured, max over ranks:
  0.088-0.176 with FP8, 0.0075-0.0102 for bf16 without it; the same as one device gets by
  quantizing whole Q, K, V and O once, 0.173 for the first case: K and V are 3x randn, so
  the scores are sharp) and is larger than without FP8 (the quantization ran);
- off (the default): the output is bitwise the same as with ``fp8_comms=False``.
"""
import math

import pytest
import torch
import torch.distributed as dist

import xfuser_swiftfusion as sf
from xfuser_swiftfusion.emulation.launcher import run_emulated
from xfuser_swiftfusion.strategies import fp8

from support.reference import rank_rows

STRATEGIES = ("tas", "torus", "swiftfusion")
FP8_BOUND = 0.25  # max abs error / max |reference output|, bf16 inputs with fp8_comms
# (topology, heads, K/V heads, Ulysses degree or None, text tokens): (T, U, R)
CASES = {("2x2", 4, 4, None, 3): (2, 2, 1), ("2x2", 4, 2, 2, 0): (2, 1, 2),
         ("4x2", 4, 4, None, 5): (4, 1, 2)}


def _run(heads: int, heads_kv: int, ulysses: int | None, Tj: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    B, S, D = 2, 8, 16
    q = torch.randn(B, heads, world * S, D, generator=g)
    k, v = (torch.randn(B, heads_kv, world * S, D, generator=g) * 3 for _ in range(2))
    joint = tuple(torch.randn(B, h, Tj, D, generator=g) for h in (heads, heads_kv, heads_kv)) if Tj else None
    ref = rank_rows(q, k, v, rank, world, joint, "front")
    bf = lambda x: x.to(torch.bfloat16)  # noqa: E731
    mine = lambda x: bf(x[:, :, rank * S:(rank + 1) * S])  # noqa: E731
    kw = {} if joint is None else dict(joint_query=bf(joint[0]), joint_key=bf(joint[1]),
                                       joint_value=bf(joint[2]), joint_strategy="front")
    out = {}
    for strategy in STRATEGIES:
        for options in (None, {"fp8_comms": False}, {"fp8_comms": True}):
            with sf.init_sequence_parallel(strategy, heads, ulysses_degree=ulysses, timeout_s=60,
                                           options=options) as ctx:
                ctx.attention(mine(q), mine(k), mine(v), **kw)  # first call: buffers
                ctx.reset_stats()
                o = ctx.attention(mine(q), mine(k), mine(v), **kw)
                stats = ctx.stats()
                m = ctx.mesh
                out[strategy, None if options is None else options["fp8_comms"]] = {
                    "out": o, "err": (o.double() - ref).abs().max().item() / ref.abs().max().item(),
                    "tur": (m.torus, m.ulysses_intra, m.ring),
                    **{n: stats[n] for n in ("inter_node_bytes", "intra_node_bytes", "transfers",
                                             "grouped_exchanges", "barriers")}}
    return out


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"{c[0]}-H{c[1]}-Hkv{c[2]}-U{c[3]}-Tj{c[4]}")
def test_fp8_comms_halves_inter_machine_bytes_within_error_bound(case):
    topology, *args = case
    T, U, R = CASES[case]
    for rank, res in enumerate(run_emulated(_run, topology, *args, timeout_s=180)):
        for s in STRATEGIES:
            off, on, default = res[s, False], res[s, True], res[s, None]
            assert on["tur"] == off["tur"] == (T, U, R), (s, on["tur"])
            assert torch.equal(default["out"], off["out"]), (rank, s)  # off is the default path
            scales = 4 * U * (T - 1)  # Q, K, V in and O out, per GPU of the other machines
            assert off["inter_node_bytes"] % 2 == 0
            assert on["inter_node_bytes"] == off["inter_node_bytes"] // 2 + 4 * scales, (rank, s, on, off)
            for n in ("intra_node_bytes", "transfers", "grouped_exchanges", "barriers"):
                assert on[n] == off[n] == default[n], (rank, s, n, on[n], off[n])
            assert on["out"].dtype == torch.bfloat16
            assert off["err"] < on["err"] <= FP8_BOUND, (rank, s, off["err"], on["err"])


def test_wire_round_trip_error_and_layout():
    """Per element ``|x - deq| <= 2^-4 |x| + scale 2^-10`` (e4m3: 3 mantissa bits, round to
    nearest; subnormal spacing 2^-9); an all-zero part comes back 0, a NaN part all NaN;
    the scales sit after the payloads, fp32, one per (slot, part)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 5, 7, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None, None, None]
    y = torch.randn(3, 2, 5, 7, generator=g)
    y[1] = 0
    wire = fp8.wire_empty(lambda s, d: torch.empty(s, dtype=d), (3,), 70, parts=2)
    assert wire.shape == (3, 2 * 70 + 8) and wire.dtype == torch.uint8
    fp8.quantize_(wire, x, y)
    scales = wire[:, 140:].contiguous().view(torch.float32)  # [3, 2]
    want = torch.stack([x.flatten(1).abs().amax(1), y.flatten(1).abs().amax(1)], 1) / 448
    assert torch.equal(scales, torch.where(want > 0, want, torch.ones_like(want)))
    a, b = torch.empty_like(x), torch.empty_like(y)
    fp8.dequantize_(wire, a, b)
    for src, got, s in ((x, a, scales[:, 0]), (y, b, scales[:, 1])):
        s = s[:, None, None, None]
        assert ((got - src).abs() <= 2 ** -4 * src.abs() + s * 2 ** -10).all()
    assert torch.equal(b[1], torch.zeros_like(b[1]))
    assert (a - x).abs().max() > 0  # it does quantize
    x[2, 0, 0, 0] = math.nan
    fp8.quantize_(wire, x, y)
    fp8.dequantize_(wire, a, b)
    assert a[2].isnan().all() and not a[:2].isnan().any()


def test_fp8_option_must_be_a_bool():
    assert fp8.enabled({}) is False and fp8.enabled({"fp8_comms": True}) is True
    with pytest.raises(TypeError, match="fp8_comms"):
        fp8.enabled({"fp8_comms": "yes"})


def test_quantize_rejects_a_wire_that_is_not_a_slot():
    """A wire must be ``uint8 [*lead, P * (m + 4)]`` with ``m >= 1``."""
    assert fp8.wire_bytes(5) == 9 and fp8.wire_bytes(5, 3) == 27
    assert fp8.wire_empty(lambda s, d: torch.empty(s, dtype=d), (2,), 5).shape == (2, 9)
    fp8.quantize_(torch.empty(2, 5, dtype=torch.uint8), torch.randn(2, 1))  # m = 1: a slot
    for wire, parts in ((torch.empty(2, 4, dtype=torch.uint8), 1),      # m = 0
                        (torch.empty(2, 17, dtype=torch.uint8), 2),     # not 2 (m + 4)
                        (torch.empty(2, 8, dtype=torch.float32), 1)):   # not uint8
        with pytest.raises(ValueError, match="is not a uint8 slot"):
            fp8.quantize_(wire, *[torch.randn(2, 4)] * parts)


def test_arrival_waits_its_handles_then_dequantizes_once():
    log = []

    class Handle:
        def __init__(self, name):
            self.name = name

        def wait(self):
            log.append(self.name)

    arrival = fp8.Arrival([Handle("k"), Handle("v")], lambda: log.append("then"))
    arrival.wait()
    arrival.wait()
    assert log == ["k", "v", "then"]


def test_wire_round_trip_with_two_lead_dimensions():
    """A wire ``[2, 3, P * (m + 4)]``: one scale per (lead index, part), each part back within
    the e4m3 bound of the module docstring."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 5, generator=g) * torch.tensor([1.0, 10.0, 100.0])[None, :, None, None]
    y = torch.randn(2, 3, 20, generator=g)
    wire = fp8.wire_empty(lambda s, d: torch.empty(s, dtype=d), (2, 3), 20, parts=2)
    fp8.quantize_(wire, x, y)
    scales = wire[..., 40:].contiguous().view(torch.float32)  # [2, 3, 2]
    assert torch.equal(scales[..., 0], x.flatten(2).abs().amax(-1) / 448)
    a, b = torch.empty_like(x), torch.empty_like(y)
    fp8.dequantize_(wire, a, b)
    for src, got, s in ((x, a, scales[..., 0]), (y, b, scales[..., 1])):
        s = s.reshape(2, 3, *[1] * (src.dim() - 2))
        assert ((got - src).abs() <= 2 ** -4 * src.abs() + s * 2 ** -10).all()
