"""The ``torus`` strategy end to end in one process: ``build_torus`` -> ``TorusAttention`` over
the real ``TwoSidedTorusIO``, every rank a thread with its own in-process two-sided
communicator (``support/inproc_comm.py``: NCCL's matching, messages landing at a wait or at
once), on meshes T in {2, 3}, U in {1, 2}, R in {1, 2}; against the fp64 reference
(``support/reference.py``; with ``fp8_comms``, the reference's inputs and outputs go through
the documented wire format where they cross machines). The cost model's ops
(``TwoSidedTorusOps``, ``torus_ops``) are checked against hand-counted lists and against the
exchanges the transport posted.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from xfuser_swiftfusion.groups import SPGroups
from xfuser_swiftfusion.mesh import Mesh
from xfuser_swiftfusion.strategies import ring, torus
from xfuser_swiftfusion.strategies.layout import Joint, KeyMask
from xfuser_swiftfusion.strategies.ops import Attend, Copy, Shape, Transfer, Wait, counts, sent_bytes
from xfuser_swiftfusion.strategies.torus import TwoSidedTorusOps, torus_ops
from xfuser_swiftfusion.topology import Topology
from support.fp64_kernel import attend64, new_state64
from support.inproc_comm import Fabric
from support.reference import attention, max_abs_err, rank_rows

B, S, D, SCALE = 2, 2, 4, 0.4
MESHES = [(T, U, R) for T in (2, 3) for U in (1, 2) for R in (1, 2)]


def make_mesh(T: int, U: int, R: int) -> Mesh:
    """T machines of U*R GPUs, Ulysses T*U across them, ring R inside (tas placement)."""
    return Mesh(Topology(T, U * R), T * U, R, "tas")


@pytest.fixture
def fp64_kernel(monkeypatch):
    monkeypatch.setattr(torus, "attend", attend64)
    monkeypatch.setattr(ring, "attend", attend64)  # PassRing's steps
    monkeypatch.setattr(torus, "new_states", lambda chunks: [new_state64(c) for c in chunks])


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """One wire slot (``fp8.py``'s format, written here from its description): scale
    ``amax / 448`` in fp32 (1 for a zero slot), e4m3 payload, back as ``fp8 * scale``."""
    xs = x.float()
    amax = xs.abs().amax()
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    return ((xs / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def fp8_reference(mesh: Mesh, q, k, v, joint, where, tokens, text) -> list[torch.Tensor]:
    """Each rank's rows ``[B, H, S + Tj, D]`` as the fp8 wire gives them: head group g = (a, b)
    is computed on machine a, from Q, K, V slots ``[B, h(_kv), S, D]`` of the ranks of other
    machines round-tripped through fp8 (K/V repeated to ``lcm(H_kv, T U)`` heads first), its
    output slot (image rows, then text rows) round-tripped where it returns to another machine."""
    T, U, W = mesh.torus, mesh.ulysses_intra, mesh.world_size
    G, (B, H, L, _) = T * U, q.shape
    S = L // W
    f = math.lcm(k.shape[1], G) // k.shape[1]
    k, v = k.repeat_interleave(f, 1), v.repeat_interleave(f, 1)
    h, hk = H // G, k.shape[1] // G
    machine = [mesh.coords(x)[0] for x in range(W)]
    sl = lambda y: slice(y * S, (y + 1) * S)  # noqa: E731
    out = []
    for x in range(W):
        rows = []
        for g in range(G):
            a = g // U
            wire = lambda t, y: fp8_round_trip(t) if machine[y] != a else t  # noqa: E731
            qh, kh = slice(g * h, (g + 1) * h), slice(g * hk, (g + 1) * hk)
            keys = torch.cat([wire(k[:, kh, sl(y)], y) for y in range(W)], 2)
            vals = torch.cat([wire(v[:, kh, sl(y)], y) for y in range(W)], 2)
            mask = tokens
            if joint is not None:
                jk, jv = (t.repeat_interleave(f, 1)[:, kh] for t in joint[1:])
                keys, vals = torch.cat([jk, keys], 2), torch.cat([jv, vals], 2)
                if tokens is not None or text is not None:
                    ones = lambda n: torch.ones(B, n, dtype=torch.bool)  # noqa: E731
                    mask = torch.cat([ones(jk.shape[2]) if text is None else text,
                                      ones(W * S) if tokens is None else tokens], 1)
            img = attention(wire(q[:, qh, sl(x)], x), keys, vals, SCALE, mask)
            slot = img if joint is None else torch.cat([img, attention(joint[0][:, qh], keys, vals, SCALE, mask)], 2)
            if machine[x] != a:  # one wire slot: the image rows, then the text rows
                img_t = (slot[:, :, :S], slot[:, :, S:])
                flat = fp8_round_trip(torch.cat([t.flatten() for t in img_t]))
                slot = torch.cat([flat[:img.numel()].view(img.shape),
                                  flat[img.numel():].view(img_t[1].shape)], 2)
            rows.append(slot)
        o = torch.cat(rows, 1)  # [B, H, S + Tj, D], image rows first
        if joint is not None and where == "front":
            o = torch.cat([o[:, :, S:], o[:, :, :S]], 2)
        out.append(o.to(q.dtype))
    return out


def layer_inputs(mesh: Mesh, *, Tj: int = 0, where: str = "front", masked: bool = False,
                 kv_heads: int | None = None, fp8: bool = False, tokens: int = S, batch: int = B,
                 dtype: torch.dtype = torch.float64, seed: int = 0):
    """One call's global inputs (``tokens`` per rank, ``2 T U`` query heads, ``kv_heads`` K/V
    heads, ``Tj`` text tokens, a random key mask of image and text keys) and every rank's
    reference rows (``fp8``: as the fp8 wire gives them)."""
    W, H = mesh.world_size, 2 * mesh.torus * mesh.ulysses_intra
    g = torch.Generator().manual_seed(seed + 7 * W + 3 * H + Tj)
    Hkv = H if kv_heads is None else kv_heads
    new = lambda n, L: torch.randn(batch, n, L, D, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    q, k, v = new(H, W * tokens), new(Hkv, W * tokens), new(Hkv, W * tokens)
    jq, jk, jv = new(H, Tj), new(Hkv, Tj), new(Hkv, Tj)
    joint = Joint(jq, jk, jv, where) if Tj else None
    mask = text = key_mask = None
    if masked:
        mask = torch.rand(batch, W * tokens, generator=g) < 0.6
        mask[:, 0] = True  # every query keeps a key
        text = (torch.rand(batch, Tj, generator=g) < 0.6) if Tj else None
        key_mask = KeyMask(mask, tokens, text)
    if fp8:
        refs = fp8_reference(mesh, q, k, v, (jq, jk, jv) if Tj else None, where, mask, text)
    else:
        refs = [rank_rows(q, k, v, x, W, (jq, jk, jv), where, SCALE, mask, text).to(dtype)
                for x in range(W)]
    return (q, k, v, joint, key_mask, tokens), refs


def run_torus(T: int, U: int, R: int, *, launches: str | None = "ring", land: str = "wait",
              planned: bool = False, fp8: bool = False, calls: list[dict] | None = None,
              repeat: int = 1, kv_pieces: int | None = None, **one):
    """Run one ``torus`` strategy per rank through ``calls`` (keyword arguments of
    ``layer_inputs`` each; default: ``one``), each ``repeat`` times; return each rank's outputs
    (call after call), the references (alike), the fabric and each rank's communicator.
    ``kv_pieces``: that option (None: absent). ``planned``: through the strategy's plans
    ``layer`` (the kernels the caller put in place)."""
    mesh, W = make_mesh(T, U, R), T * U * R
    made = [layer_inputs(mesh, fp8=fp8, **c) for c in (calls or [one])]
    options = {"fp8_comms": fp8} | ({} if launches is None else {"launches": launches})
    options |= {} if kv_pieces is None else {"kv_pieces": kv_pieces}
    fabric = Fabric(W, [mesh.topology.node_of(x) for x in range(W)], land=land)
    comms = [None] * W

    def rank_main(x: int):
        comm = comms[x] = fabric.comm(x)
        a = SimpleNamespace(two_sided=lambda: comm, groups=SPGroups(mesh, x), rank=x, mesh=mesh,
                            options=options)
        attn = torus.build_torus(a)
        run = attn if planned else attn.layer
        outs = []
        for (q, k, v, joint, key_mask, n), _ in made:
            mine = slice(x * n, (x + 1) * n)
            outs += [run(q[:, :, mine], k[:, :, mine], v[:, :, mine], joint, SCALE, key_mask).clone()
                     for _ in range(repeat)]
        return outs

    outs = fabric.run(rank_main)
    refs = [[refs[x] for _, refs in made for _ in range(repeat)] for x in range(W)]
    return outs, refs, fabric, comms


def errors(outs, refs) -> list[float]:
    return [max_abs_err(o, r) if o.shape == r.shape and o.dtype == r.dtype else math.inf
            for os, rs in zip(outs, refs) for o, r in zip(os, rs, strict=True)]


def posted(fabric: Fabric, x: int) -> list[tuple]:
    """Rank x's exchanges that moved something: (queue, sends, recvs)."""
    return [(qu, s, r) for y, qu, _, s, r in fabric.log if y == x and (s or r)]


def transfers(ops) -> list[tuple]:
    return [(t.queue, t.sends, t.recvs) for t in ops if isinstance(t, Transfer)]


def posted_as_the_ops(fabric: Fabric, comms, m: Mesh, tokens: int, Tj: int, launches: str,
                      P: int = 1) -> None:
    """Each rank's posted exchanges are ``torus_ops``' transfers (with ``P`` pieces), in order,
    and its byte, message and grouped-call counters their sums."""
    T, U = m.torus, m.ulysses_intra
    for x, c in enumerate(comms):
        ops = torus_ops(TwoSidedTorusOps(m, x, Shape(B, tokens, 2 * T * U, D, Tj, itemsize=8), P), launches)
        assert posted(fabric, x) == transfers(ops), x
        other = {y for y in range(m.world_size) if m.topology.node_of(y) != m.topology.node_of(x)}
        assert (c.counter.inter_node_bytes, c.counter.intra_node_bytes) == (
            sent_bytes(ops, other), sent_bytes(ops) - sent_bytes(ops, other)), x
        n = counts(ops)
        assert (c.counter.messages, c.counter.grouped_calls) == (n["transfers"], n["grouped_exchanges"]), x


CASES = [  # (T, U, R), launches, Tj, where, masked, kv_heads, land; j = 2 i (+ 1 for stage)
    (m, launches, 2 if i % 3 else 0, "front" if i % 2 else "rear", i % 4 in (1, 2),
     1 if j % 5 == 4 else None, "post" if (i + (launches == "stage")) % 2 else "wait")
    for i, m in enumerate(MESHES) for launches in ("ring", "stage")
    for j in [2 * i + (launches == "stage")]]


@pytest.mark.parametrize("mesh,launches,Tj,where,masked,kv_heads,land", CASES)
def test_torus_over_the_two_sided_transport_matches_softmax_attention(
        fp64_kernel, mesh, launches, Tj, where, masked, kv_heads, land):
    """Every rank's rows against the fp64 reference; without GQA, each rank's posted
    exchanges are the cost model's transfers, in order, and its byte counters their sums."""
    T, U, R = mesh
    outs, refs, fabric, comms = run_torus(T, U, R, Tj=Tj, where=where, masked=masked,
                                          kv_heads=kv_heads, launches=launches, land=land)
    assert max(errors(outs, refs)) <= 1e-10, errors(outs, refs)
    if R == 1:  # a ring of one calls nothing on the ring queue
        assert not [e for e in fabric.log if e[1] == "ring"]
    if kv_heads is not None:
        return
    posted_as_the_ops(fabric, comms, make_mesh(T, U, R), S, Tj, launches)


CHANGING = [dict(Tj=2, masked=True), dict(seed=1), dict(Tj=3, where="rear", seed=2),
            dict(Tj=2, kv_heads=1, seed=3), dict(Tj=2, seed=9), dict(Tj=2, tokens=3, masked=True, seed=4),
            dict(Tj=2, dtype=torch.float32, seed=5), dict(Tj=1, batch=1, seed=6), dict(Tj=2, seed=7)]


@pytest.mark.parametrize("mesh,launches,land", [((2, 1, 2), "ring", "wait"), ((2, 2, 2), "stage", "post"),
                                                ((3, 1, 2), "stage", "wait")])
def test_one_transport_serves_changing_inputs(fp64_kernel, mesh, launches, land):
    """One strategy per rank, called with another text length, placement, key mask, K/V head
    count, sequence, dtype or batch each time, then as the first call again: every output
    matches the reference (a buffer or a gathered block of an earlier call never leaks)."""
    T, U, _ = mesh  # and as many tokens per rank as query heads, with one K/V head
    calls = [*CHANGING, dict(Tj=1, tokens=2 * T * U, kv_heads=1, seed=8)]
    outs, refs, _, _ = run_torus(*mesh, launches=launches, land=land, calls=calls)
    assert max(errors(outs, refs)) <= 1e-6, errors(outs, refs)


FP8_CASES = [((2, 1, 2), "ring", 2, True, None), ((2, 2, 1), "stage", 2, True, None),
             ((3, 2, 1), "ring", 0, False, None), ((3, 1, 2), "stage", 1, True, None),
             ((2, 2, 2), "ring", 2, False, 1), ((3, 2, 2), "stage", 2, True, 2)]


@pytest.mark.parametrize("mesh,launches,Tj,masked,kv_heads", FP8_CASES)
def test_fp8_comms_move_wire_slots_across_machines(fp64_kernel, mesh, launches, Tj, masked, kv_heads):
    """What crosses machines arrives as the fp8 wire format gives it (the rest exact); the
    bytes across machines are the wire slots' (fp8 payload + one fp32 scale per slot)."""
    T, U, R = mesh
    outs, refs, fabric, comms = run_torus(T, U, R, Tj=Tj, masked=masked, kv_heads=kv_heads,
                                          fp8=True, launches=launches, where="rear" if T == 3 else "front")
    assert max(errors(outs, refs)) <= 1e-9, errors(outs, refs)
    G, H = T * U, 2 * T * U
    hk = math.lcm(kv_heads or H, G) // G
    h = H // G
    # per machine stage k = 1..T-1, to U peers: Q, K, V slots and an output slot (+4 bytes each)
    want = (T - 1) * U * ((B * h * S * D + 4) + 2 * (B * hk * S * D + 4) + (B * h * (S + Tj) * D + 4))
    assert {c.counter.inter_node_bytes for c in comms} == {want}


@pytest.mark.parametrize("launches", ["ring", "stage"])
def test_plans_over_the_two_sided_transport_replay_its_exchanges(launches):
    """Through the plans (compiled at the first call, replayed at the second; the real
    kernels, fp64 inputs): both calls match the reference."""
    outs, refs, fabric, comms = run_torus(2, 2, 2, Tj=2, masked=True, launches=launches,
                                          planned=True, repeat=2)
    assert max(errors(outs, refs)) <= 1e-5, errors(outs, refs)
    assert len({len(posted(fabric, x)) for x in range(8)}) == 1


def test_launches_follow_the_device_without_the_option(fp64_kernel):
    """No ``launches`` option on CPU tensors: the ring schedule (one exchange per ring step on
    the ``ring`` queue, no all-gather)."""
    outs, refs, fabric, _ = run_torus(2, 1, 2, launches=None)
    assert max(errors(outs, refs)) <= 1e-10
    ring = [w for _, qu, w, _, _ in fabric.log if qu == "ring"]
    assert ring and all("ring step" in w for w in ring), ring


# --- the cost model's ops, counted by hand -------------------------------------------------

def test_two_sided_ops_of_a_2x2_layer_with_text():
    """T = 2, U = 2, R = 1, rank 0, ring launches: B = 1, S = 3, H = 8 (h = 2), D = 2, Tj = 1,
    2-byte elements: a slot [1, 2, 3, 2] is 24 bytes, an output slot (3 + 1 rows) 32, a
    running state of 3 rows 4 * 2 * 3 * (2 + 2) = 96 bytes, of the text row 32."""
    m = make_mesh(2, 2, 1)
    p = lambda a, b: m.rank_of(a, b, 0)  # noqa: E731
    assert m.coords(0) == (0, 0, 0)
    ops = torus_ops(TwoSidedTorusOps(m, 0, Shape(1, 3, 8, 2, 1, itemsize=2)), "ring")
    intra, inter = lambda n: ((p(0, 1), n),), lambda n: ((p(1, 0), n), (p(1, 1), n))  # noqa: E731
    X = lambda i, pairs: Transfer(f"exchange{i}", "exchange", "other", pairs, pairs)  # noqa: E731
    a = lambda q, kv, fin=False: Attend(q, kv, 2, fin)  # noqa: E731
    assert ops == [
        Copy(288),  # split_heads of Q, K, V: 3 x T U slots
        Copy(24), X(1, intra(24)), Copy(24), X(2, intra(24)), Copy(24), X(3, intra(24)),
        Wait(("exchange1", "exchange2", "exchange3")),
        X(4, inter(24)), X(5, inter(24)), X(6, inter(24)),  # Pull-Q stage 2, Pull-KV stage 1 (K, V)
        Copy(96), Copy(96), Copy(96), Copy(96), Copy(32),  # running states: 2 x 2 chunks, the text
        a((3, 3, 1), (1,)), a((3, 3, 1), (3, 3)),  # Pull-Q stage 1: text K/V, my block
        Wait(("exchange4",)), a((3, 3), (1,)), a((3, 3), (3, 3)),  # Pull-Q stage 2
        Wait(("exchange5", "exchange6")),  # Pull-KV stage 1
        a((3, 3, 1), (3, 3)), a((1,), (), True), a((3, 3), (), True),  # machine 1's queries, text
        X(7, inter(32)),  # Push-O to machine 1
        a((3, 3), (3, 3)), a((3, 3), (), True), Copy(32), X(8, intra(32)),  # Push-O, mine
        Wait(("exchange7", "exchange8")),
        Copy(128)]  # gather_output: T U output slots
    assert counts(ops) == {"transfers": 12, "grouped_exchanges": 8, "barriers": 0, "attend_calls": 9}
    assert sent_bytes(ops, {p(1, 0), p(1, 1)}) == 3 * 48 + 64 and sent_bytes(ops) == 208 + 3 * 24 + 32


def test_two_sided_ops_of_a_ring_of_two_with_stage_launches():
    """T = 2, U = 1, R = 2, rank 0, stage launches, no text: B = 1, S = 3, H = 2 (h = 1), D = 2,
    2-byte elements: 12-byte slots; each machine's block gathered once over the ring (K, V)."""
    m = make_mesh(2, 1, 2)
    assert m.coords(0) == (0, 0, 0)
    peer, ring = m.rank_of(1, 0, 0), m.rank_of(0, 0, 1)
    ops = torus_ops(TwoSidedTorusOps(m, 0, Shape(1, 3, 2, 2, 0, itemsize=2)), "stage")
    X = lambda i, pairs, qu="other": Transfer(f"exchange{i}", "exchange", qu, pairs, pairs)  # noqa: E731
    a = lambda q, fin=False: Attend(q, (3, 3), 1, fin)  # noqa: E731
    kv = ((ring, 12), (ring, 12))
    assert ops == [
        Copy(72), Copy(12), Copy(12), Copy(12),  # Q, K, V of my machine: all mine (U = 1)
        X(1, ((peer, 12),)), X(2, ((peer, 12),)), X(3, ((peer, 12),)),
        Copy(48), Copy(48),
        X(4, kv, "ring"), Wait(("exchange4",)), a((3,)),  # my block from my ring peer
        Wait(("exchange1",)), a((3,)),
        Wait(("exchange2", "exchange3")),
        X(5, kv, "ring"), Wait(("exchange5",)), a((3,), True),
        X(6, ((peer, 12),)),
        a((3,), True), Copy(12),
        Wait(("exchange6",)),
        Copy(24)]


def test_the_launches_and_fp8_options_are_checked_at_build():
    m = make_mesh(2, 1, 1)
    a = lambda options: SimpleNamespace(two_sided=lambda: Fabric(2).comm(0), groups=SPGroups(m, 0),  # noqa: E731
                                        rank=0, mesh=m, options=options)
    with pytest.raises(ValueError, match="'launches' must be one of .*'fused'"):
        torus.build_torus(a({"launches": "fused"}))
    with pytest.raises(TypeError, match="fp8_comms"):
        torus.build_torus(a({"fp8_comms": "yes"}))
    for value in (None, "ring", "stage"):
        assert torus.build_torus(a({} if value is None else {"launches": value})).launches == value


def storage_bytes(tree) -> int:
    """Bytes of the distinct storages under a nest of dicts, lists, tensors and ``Slots``."""
    seen: dict[int, int] = {}

    def walk(x):
        if isinstance(x, (dict, list)):
            for y in (x.values() if isinstance(x, dict) else x):
                walk(y)
        elif isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif x is not None and hasattr(x, "flat"):
            walk({"flat": x.flat, "rows": x.rows, "text": x.text})
    walk(tree)
    return sum(seen.values())


@pytest.mark.parametrize("mesh,launches,fp8,Tj,P", [
    ((2, 2, 2), "stage", None, 2, 1), ((1, 2, 1), "ring", True, 1, 1), ((2, 1, 2), "stage", True, 0, 1),
    ((3, 1, 1), "ring", False, 2, 1), ((3, 2, 1), "stage", False, 1, 2), ((1, 2, 2), "ring", None, 0, 2),
    ((2, 1, 2), "stage", None, 1, 2)])
def test_the_transport_holds_the_buffers_its_layout_needs(fp64_kernel, mesh, launches, fp8, Tj, P):
    """``TwoSidedTorusIO`` built as ``build_torus`` builds it (``fp8``: None leaves the
    constructor's default, off): after a call its buffers are exactly, in bytes, the output
    slots O and Ob ([T, U] of B h (S + Tj) D; Q lives in O's image rows), K and V
    [T, U, B, h_kv, S, D], the send copies of Q, K, V, the ring's gathered K/V [T, R - 1, U, ...]
    (stage launches, R > 1), the fp8 wire slots (T > 1: send and receive, payload + 4 bytes)
    and with ``kv_pieces`` P > 1 (T > 1) the piece-major K and V, sent and received (U slots each),
    and their ring gathers [R - 1, U, ...] (stage launches, R > 1)."""
    T, U, R = mesh
    m, W = make_mesh(T, U, R), T * U * R
    (q, k, v, joint, key_mask, _), refs = layer_inputs(m, Tj=Tj, kv_heads=1, fp8=bool(fp8) and T > 1)
    fabric = Fabric(W, [m.topology.node_of(x) for x in range(W)])

    def rank_main(x):
        comm = fabric.comm(x)
        io = torus.TwoSidedTorusIO(SPGroups(m, x), comm, x, *([] if fp8 is None else [fp8]))
        attn = torus.TorusAttention(torus.SPEC, m, io, x, [comm], {"launches": launches, "kv_pieces": P})
        mine = slice(x * S, (x + 1) * S)
        return attn.layer(q[:, :, mine], k[:, :, mine], v[:, :, mine], joint, SCALE, key_mask), io

    res = fabric.run(rank_main)
    assert max(errors([[o] for o, _ in res], [[r] for r in refs])) <= 1e-9
    G, H = T * U, 2 * T * U
    h, hk, e = H // G, math.lcm(1, G) // G, 8  # one K/V head repeated to lcm(1, G) heads
    img, kv, out = B * h * S * D, B * hk * S * D, B * h * (S + Tj) * D
    want = G * e * (2 * out + 2 * kv + img + 2 * kv)
    if launches == "stage" and R > 1:
        want += 2 * T * (R - 1) * U * kv * e
    if fp8 and T > 1:
        want += 2 * G * ((img + 4) + 2 * (kv + 4) + (out + 4))
    if P > 1 and T > 1:
        want += 2 * 2 * U * kv * e
        if launches == "stage" and R > 1:  # the ring's gathered pieces [R - 1, U, ...], K and V
            want += 2 * (R - 1) * U * kv * e
    for _, io in res:
        assert len(io._buffers) == 1 and storage_bytes(io._buffers) == want


def test_torus_ops_call_the_ring_barrier_of_every_pull_kv_stage():
    """T = 3, R = 2, rank 0 over the one-sided ops (whose ring barrier is a sync of the ring
    group): one sync per Pull-KV stage (k = 1, 2), each right after that stage's K/V wait."""
    from xfuser_swiftfusion.strategies.ops import Barrier
    from xfuser_swiftfusion.strategies.swiftfusion import OneSidedTorusOps
    m = make_mesh(3, 1, 2)
    ring_group = (0, m.rank_of(0, 0, 1))
    for launches in ("ring", "stage"):
        ops = torus_ops(OneSidedTorusOps(m, 0, Shape(1, 2, 6, 2)), launches)
        syncs = [i for i, op in enumerate(ops) if op == Barrier(ring_group, quiet=False)]
        assert len(syncs) == 2 and all(isinstance(ops[i - 1], Wait) for i in syncs), launches


# --- kv_pieces: the last Pull-KV stage's K/V in P pieces ------------------------------------

PIECE_CASES = [  # (T, U, R), P, tokens, launches, Tj, where, masked, kv_heads, land
    ((2, 1, 1), 2, 3, "ring", 2, "front", True, None, "wait"),
    ((2, 1, 2), 3, 3, "stage", 0, "rear", False, 1, "post"),
    ((2, 2, 2), 2, 2, "stage", 2, "rear", True, None, "wait"),
    ((3, 1, 1), 3, 2, "ring", 1, "front", False, None, "post"),  # P > tokens: 2 pieces
    ((3, 1, 2), 2, 3, "ring", 2, "rear", True, 1, "wait"),
    ((3, 2, 1), 3, 3, "stage", 2, "front", True, None, "post"),
    ((3, 1, 2), 2, 3, "stage", 0, "front", False, None, "wait"),
    ((2, 2, 1), 3, 2, "stage", 1, "rear", True, None, "post"),  # P > tokens: 2 pieces
]


@pytest.mark.parametrize("mesh,P,tokens,launches,Tj,where,masked,kv_heads,land", PIECE_CASES)
def test_kv_pieces_over_the_two_sided_transport_match_softmax_attention(
        fp64_kernel, mesh, P, tokens, launches, Tj, where, masked, kv_heads, land):
    """With ``kv_pieces`` P, every rank's rows against the fp64 reference; without GQA, each
    rank's posted exchanges are the cost model's transfers with the pieces (``min(P, tokens)``
    of them), in order, and its byte counters their sums."""
    T, U, R = mesh
    outs, refs, fabric, comms = run_torus(T, U, R, Tj=Tj, where=where, masked=masked, tokens=tokens,
                                          kv_heads=kv_heads, launches=launches, land=land, kv_pieces=P)
    assert max(errors(outs, refs)) <= 1e-10, errors(outs, refs)
    pieces = [w for y, _, w, s, _ in fabric.log if y == 0 and s and "piece" in w and "ring" not in w]
    assert len(pieces) == min(P, tokens), pieces  # one exchange per piece of the last stage
    if R == 1:  # a ring of one calls nothing on the ring queue, pieces or not
        assert not [e for e in fabric.log if e[1] == "ring"]
    if kv_heads is not None:
        return
    posted_as_the_ops(fabric, comms, make_mesh(T, U, R), tokens, Tj, launches, P)


def test_more_kv_pieces_than_tokens_move_one_row_each_logged_once(fp64_kernel, caplog, monkeypatch):
    """``kv_pieces`` 5 over 3 tokens per GPU: 3 pieces of one row (messages of one row's
    bytes, in each of 2 calls), the warning logged once for all ranks and calls; results as the
    reference."""
    from xfuser_swiftfusion import log
    monkeypatch.setattr(log, "_seen", set())
    with caplog.at_level("WARNING", logger="xfuser.swiftfusion"):
        outs, refs, fabric, _ = run_torus(2, 1, 2, Tj=1, tokens=3, kv_pieces=5, repeat=2)
    assert max(errors(outs, refs)) <= 1e-10, errors(outs, refs)
    msgs = [r.getMessage() for r in caplog.records if "kv_pieces" in r.getMessage()]
    assert msgs == ["torus: kv_pieces=5 exceeds the 3 tokens per GPU; "
                    "the last Pull-KV stage moves in 3 pieces of one row"], msgs
    row = B * 2 * 1 * D * 8  # [B, h = 2, 1, D] fp64: K's, then V's, one message each (U = 1)
    sends = [s for y, qu, w, s, _ in fabric.log if y == 0 and qu == "other" and "piece" in w]
    assert len(sends) == 2 * 3 and {tuple(n for _, n in s) for s in sends} == {(row, row)}, sends


def test_two_sided_ops_of_two_kv_pieces():
    """T = 2, U = 1, R = 1, rank 0, ring launches, kv_pieces 2: B = 1, S = 3, H = 2 (h = 1),
    D = 2, 2-byte elements: a slot is 12 bytes; the last (only) Pull-KV stage's K/V in pieces
    of rows 0-1 (K and V 8 bytes each) and row 2 (4 bytes each), one exchange per piece."""
    m = make_mesh(2, 1, 1)
    peer = m.rank_of(1, 0, 0)
    ops = torus_ops(TwoSidedTorusOps(m, 0, Shape(1, 3, 2, 2, 0, itemsize=2), 2), "ring")
    X = lambda i, n, k=1: Transfer(f"exchange{i}", "exchange", "other", ((peer, n),) * k,  # noqa: E731
                                   ((peer, n),) * k)
    a = lambda q, kv, fin=False: Attend(q, kv, 1, fin)  # noqa: E731
    assert ops == [
        Copy(72),  # split_heads of Q, K, V: 3 x T U slots
        Copy(24),  # my K, V slots for machine 1 into the piece buffers
        Copy(12), Copy(12), Copy(12),  # stage 0: Q, K, V of my machine, all mine (U = 1)
        X(1, 12),  # Pull-Q stage 1
        X(2, 8, 2), X(3, 4, 2),  # Pull-KV stage 1: piece 1 (K, V of 2 rows), piece 2 (1 row)
        Copy(48), Copy(48),  # running states of my Q and machine 1's (3 rows: 4 * 3 * (2 + 2))
        a((3,), (3,)),  # my Q against my K/V
        Wait(("exchange1",)), a((3,), (3,)),  # machine 1's Q against my K/V
        Wait(("exchange2",)), a((3, 3), (2,)),  # both against piece 1
        Wait(("exchange3",)), a((3,), (1,)), a((3,), (), True),  # machine 1's Q: piece 2, final
        X(4, 12),  # Push-O to machine 1
        a((3,), (1,)), a((3,), (), True), Copy(12),  # mine: piece 2, final, into my output slot
        Wait(("exchange4",)),
        Copy(24)]  # gather_output: T U output slots
    assert counts(ops) == {"transfers": 6, "grouped_exchanges": 4, "barriers": 0, "attend_calls": 7}
    assert sent_bytes(ops, {peer}) == 12 + 2 * 8 + 2 * 4 + 12


def test_kv_pieces_option_is_checked_at_build():
    m = make_mesh(2, 1, 1)
    a = lambda options: SimpleNamespace(two_sided=lambda: Fabric(2).comm(0), groups=SPGroups(m, 0),  # noqa: E731
                                        rank=0, mesh=m, options=options)
    made = []  # a refused option makes no communicator
    refused = lambda options: SimpleNamespace(two_sided=lambda: made.append(1), groups=SPGroups(m, 0),  # noqa: E731
                                              rank=0, mesh=m, options=options)
    for bad in (0, -1, True, "2", 2.0):
        with pytest.raises(ValueError, match=r"option 'kv_pieces' must be an int >= 1, got " + repr(bad)):
            torus.build_torus(refused({"kv_pieces": bad}))
    with pytest.raises(ValueError, match=r"kv_pieces > 1 with fp8_comms is not supported; use one or the other"):
        torus.build_torus(refused({"kv_pieces": 2, "fp8_comms": True}))
    assert made == []
    shape = Shape(1, 3, 2, 2, 1, itemsize=2)  # the spec's program: no pieces unless asked
    assert torus.SPEC.program(m, 0, shape) == torus_ops(TwoSidedTorusOps(m, 0, shape), "ring")
    assert torus.SPEC.program(m, 0, shape, "ring", 2) == torus_ops(TwoSidedTorusOps(m, 0, shape, 2), "ring")
    for options, want in (({}, 1), ({"kv_pieces": 1, "fp8_comms": True}, 1), ({"kv_pieces": 3}, 3)):
        assert torus.kv_pieces_option(options) == want
        assert torus.build_torus(a(options)).kv_pieces == want


def test_the_two_sided_transport_refuses_pieces_with_fp8(fp64_kernel):
    """``stage_in(..., pieces=2)`` on a transport with fp8 wire slots (T > 1): the refusal."""
    m = make_mesh(2, 1, 1)
    io = torus.TwoSidedTorusIO(SPGroups(m, 0), Fabric(2).comm(0), 0, True)
    x = torch.zeros(B, 2, S, D)
    with pytest.raises(ValueError, match=r"kv_pieces > 1 with fp8_comms is not supported"):
        io.stage_in(x, x, x, 0, pieces=2)


@pytest.mark.parametrize("S,P,want", [
    (4, 1, [(0, 4)]), (4, 2, [(0, 2), (2, 4)]), (5, 2, [(0, 3), (3, 5)]), (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (7, 3, [(0, 3), (3, 5), (5, 7)]), (8, 3, [(0, 3), (3, 6), (6, 8)]), (9, 4, [(0, 3), (3, 5), (5, 7), (7, 9)])])
def test_piece_bounds_by_hand(S, P, want):
    assert torus.piece_bounds(S, P) == want


def test_kv_pieces_on_one_machine_change_nothing(fp64_kernel, caplog, monkeypatch):
    """T = 1 (no Pull-KV stage to split): ``kv_pieces`` 5 over 2 tokens per GPU posts what no
    pieces post, the cost model's ops are those without pieces, nothing is logged."""
    from xfuser_swiftfusion import log
    monkeypatch.setattr(log, "_seen", set())
    with caplog.at_level("WARNING", logger="xfuser.swiftfusion"):
        outs, refs, fabric, _ = run_torus(1, 2, 2, Tj=1, masked=True, kv_pieces=5, launches="stage")
    assert max(errors(outs, refs)) <= 1e-10, errors(outs, refs)
    assert not [r for r in caplog.records if "kv_pieces" in r.getMessage()]
    m = make_mesh(1, 2, 2)
    for x in range(4):
        ops = torus_ops(TwoSidedTorusOps(m, x, Shape(B, S, 4, D, 1, itemsize=8), 5), "stage")
        assert ops == torus_ops(TwoSidedTorusOps(m, x, Shape(B, S, 4, D, 1, itemsize=8)), "stage")
        assert posted(fabric, x) == transfers(ops), x


def test_kv_pieces_up_to_the_tokens_are_kept_without_a_word(caplog, monkeypatch):
    """``TorusAttention.pieces(S)``: ``kv_pieces`` when at most S (no log), else S, logged once."""
    from xfuser_swiftfusion import log
    monkeypatch.setattr(log, "_seen", set())
    m = make_mesh(2, 1, 1)
    a = SimpleNamespace(two_sided=lambda: Fabric(2).comm(0), groups=SPGroups(m, 0), rank=0, mesh=m,
                        options={"kv_pieces": 3})
    attn = torus.build_torus(a)
    with caplog.at_level("WARNING", logger="xfuser.swiftfusion"):
        assert [attn.pieces(S) for S in (3, 4, 9)] == [3, 3, 3]
        assert not caplog.records
        assert [attn.pieces(S) for S in (2, 2, 1)] == [2, 2, 1]
    assert [r.getMessage() for r in caplog.records] == [
        f"torus: kv_pieces=3 exceeds the {S} tokens per GPU; the last Pull-KV stage moves in {S} pieces of one row"
        for S in (2, 1)]


def test_the_two_sided_transport_takes_one_piece_on_one_machine(fp64_kernel):
    """``TwoSidedTorusIO.stage_in(..., pieces=3)`` at T = 1 (no Pull-KV stage): as without
    pieces, the same buffers (no piece-major K/V) and the reference's rows."""
    m = make_mesh(1, 2, 1)
    (q, k, v, joint, key_mask, _), refs = layer_inputs(m, Tj=1, masked=True)
    res = {}
    for P in (1, 3):
        fabric = Fabric(2, [0, 0])

        def rank_main(x):
            comm = fabric.comm(x)
            io = torus.TwoSidedTorusIO(SPGroups(m, x), comm, x)
            stage_in = io.stage_in
            io.stage_in = lambda q, k, v, n, pieces=1: stage_in(q, k, v, n, pieces=P)  # noqa: E731
            attn = torus.TorusAttention(torus.SPEC, m, io, x, [comm], {"launches": "ring"})
            mine = slice(x * S, (x + 1) * S)
            out = attn.layer(q[:, :, mine], k[:, :, mine], v[:, :, mine], joint, SCALE, key_mask)
            return out, io.pieces, storage_bytes(io._buffers)

        res[P] = fabric.run(rank_main)
        assert max(errors([[o] for o, _, _ in res[P]], [[r] for r in refs])) <= 1e-10, P
    assert [(p, n) for _, p, n in res[3]] == [(1, n) for _, _, n in res[1]]


@pytest.mark.parametrize("P", [2, 3])
def test_a_block_in_pieces_is_only_read_by_piece(P):
    """With pieces, the last stage's block (machine t + 1's) has no whole buffer: asking for
    it whole is an error; its pieces and every other block are there."""
    m = make_mesh(3, 1, 1)
    fabric = Fabric(3)

    def rank_main(x):
        io = torus.TwoSidedTorusIO(SPGroups(m, x), fabric.comm(x), x)
        t = torch.zeros(B, 3, 3, D, dtype=torch.float64)
        io.stage_in(t, t, t, 0, pieces=P)
        with pytest.raises(AssertionError, match=f"block {(x + 1) % 3} arrives in {P} pieces: ask for a piece"):
            io.kv_block((x + 1) % 3)
        return [io.kv_block(a)[0].shape[-2] for a in (x, (x + 2) % 3)], [io.kv_block(None, p)[0].shape[-2]
                                                                        for p in range(P)]

    rows = [hi - lo for lo, hi in torus.piece_bounds(3, P)]
    assert fabric.run(rank_main) == [([3, 3], rows)] * 3


def test_two_sided_ops_copy_my_slots_into_the_pieces_of_a_2x2_layer():
    """T = 2, U = 2, rank 0, kv_pieces 2: B = 1, S = 3, H = 8 (h = 2), D = 2, 2-byte elements
    (24-byte slots): after split_heads (3 x T U slots), my K and V slots for machine 1, U each,
    into the piece buffers (96 bytes); the rest as without pieces but the last stage's K/V."""
    m = make_mesh(2, 2, 1)
    ops = torus_ops(TwoSidedTorusOps(m, 0, Shape(1, 3, 8, 2, 0, itemsize=2), 2), "ring")
    whole = torus_ops(TwoSidedTorusOps(m, 0, Shape(1, 3, 8, 2, 0, itemsize=2)), "ring")
    assert ops[:2] == [Copy(288), Copy(96)] and whole[0] == Copy(288) and whole[1] != Copy(96)
    copies = lambda ops: [o for o in ops if isinstance(o, Copy)]  # noqa: E731
    assert copies(ops) == [Copy(288), Copy(96), *copies(whole)[1:]]


@pytest.mark.parametrize("P", [1, 2])
def test_two_sided_ops_of_one_machine_have_no_pieces(P):
    """T = 1, U = 2, R = 1, rank 0, ring launches, kv_pieces P: B = 1, S = 3, H = 2 (h = 1),
    D = 2, 2-byte elements (12-byte slots): the Ulysses exchange of my machine alone, no pieces."""
    m = make_mesh(1, 2, 1)
    peer = m.rank_of(0, 1, 0)
    ops = torus_ops(TwoSidedTorusOps(m, 0, Shape(1, 3, 2, 2, 0, itemsize=2), P), "ring")
    X = lambda i: Transfer(f"exchange{i}", "exchange", "other", ((peer, 12),), ((peer, 12),))  # noqa: E731
    assert ops == [
        Copy(72),  # split_heads of Q, K, V: 3 x T U slots
        Copy(12), X(1), Copy(12), X(2), Copy(12), X(3),  # stage 0: Q, K, V, mine and to u = 1
        Wait(("exchange1", "exchange2", "exchange3")),
        Copy(48), Copy(48),  # running states of my U = 2 query chunks
        Attend((3, 3), (3, 3), 1, False), Attend((3, 3), (), 1, True),
        Copy(12), X(4),  # Push-O: my slot, u = 1's
        Wait(("exchange4",)),
        Copy(24)]  # gather_output: T U output slots
