"""``strategies/layout.py`` directly: the input contract's checks, key masks, head groups and
slots, each against torch's own indexing (``repeat_interleave``, slices, ``cat``) or values
written out by hand."""
from __future__ import annotations

import pytest
import torch

from xfuser_swiftfusion.strategies.layout import (InputError, Joint, KeyMask, Slots, check_inputs,
                                                  check_key_mask, gather_output, grouped_kv,
                                                  repeat_heads, split_heads)


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def test_check_inputs_accepts_the_contract():
    q, k = t(2, 4, 3, 8), t(2, 2, 3, 8)
    assert check_inputs(q, k, k.clone(), 4, 2) is None
    assert check_inputs(t(1, 4, 1, 8), t(1, 4, 1, 8), t(1, 4, 1, 8), 4, 4) is None  # S_local = 1
    joint = check_inputs(q, k, k.clone(), 4, 2, t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8), "rear")
    assert isinstance(joint, Joint) and joint.length == 5 and joint.strategy == "rear"


@pytest.mark.parametrize("what,args", [
    ("3-D query", (t(2, 4, 3), t(2, 4, 3, 8), t(2, 4, 3, 8), 4, 2)),
    ("K/V sequence differs", (t(2, 4, 3, 8), t(2, 4, 4, 8), t(2, 4, 4, 8), 4, 2)),
    ("K/V batch differs", (t(2, 4, 3, 8), t(1, 4, 3, 8), t(1, 4, 3, 8), 4, 2)),
    ("K/V head dim differs", (t(2, 4, 3, 8), t(2, 4, 3, 4), t(2, 4, 3, 4), 4, 2)),
    ("K and V differ", (t(2, 4, 3, 8), t(2, 4, 3, 8), t(2, 2, 3, 8), 4, 2)),
    ("no K/V heads", (t(2, 4, 3, 8), t(2, 0, 3, 8), t(2, 0, 3, 8), 4, 2)),
    ("K/V heads do not divide", (t(2, 4, 3, 8), t(2, 3, 3, 8), t(2, 3, 3, 8), 4, 2)),
    ("dtypes differ", (t(2, 4, 3, 8), t(2, 4, 3, 8, dtype=torch.float64), t(2, 4, 3, 8), 4, 2)),
    ("integers", (t(2, 4, 3, 8, dtype=torch.int32),) * 3 + (4, 2)),
    ("head count", (t(2, 4, 3, 8), t(2, 4, 3, 8), t(2, 4, 3, 8), 8, 2)),
    ("Ulysses degree", (t(2, 4, 3, 8), t(2, 4, 3, 8), t(2, 4, 3, 8), 4, 3)),
    ("no tokens", (t(2, 4, 0, 8), t(2, 4, 0, 8), t(2, 4, 0, 8), 4, 2)),
])
def test_check_inputs_refuses(what, args):
    with pytest.raises(InputError):
        check_inputs(*args)


@pytest.mark.parametrize("what,joint", [
    ("text query alone", (t(2, 4, 5, 8), None, None, "front")),
    ("no placement", (t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8), None)),
    ("placement", (t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8), "middle")),
    ("text K heads", (t(2, 4, 5, 8), t(2, 4, 5, 8), t(2, 2, 5, 8), "front")),
    ("text query heads", (t(2, 2, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8), "front")),
    ("text batch", (t(1, 4, 5, 8), t(1, 2, 5, 8), t(1, 2, 5, 8), "front")),
    ("text head dim", (t(2, 4, 5, 4), t(2, 2, 5, 4), t(2, 2, 5, 4), "front")),
    ("text dtype", (t(2, 4, 5, 8), t(2, 2, 5, 8, dtype=torch.float64), t(2, 2, 5, 8), "front")),
    ("text lengths", (t(2, 4, 5, 8), t(2, 2, 6, 8), t(2, 2, 6, 8), "front")),
    ("text K and V", (t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 2, 6, 8), "front")),
])
def test_check_inputs_refuses_joint(what, joint):
    q, k = t(2, 4, 3, 8), t(2, 2, 3, 8)
    with pytest.raises(InputError):
        check_inputs(q, k, k.clone(), 4, 2, *joint)


def test_key_masks_canonical_and_checked():
    q = t(2, 4, 3, 8)
    m = torch.rand(2, 6) > 0.5
    km = check_key_mask(m[:, None, None], None, q, 2, None)  # xFuser's [B, 1, 1, L]
    assert km.S == 3 and km.text is None and torch.equal(km.tokens, m)
    joint = Joint(t(2, 4, 5, 8), t(2, 4, 5, 8), t(2, 4, 5, 8), "front")
    tm = torch.rand(2, 5) > 0.5
    km = check_key_mask(None, tm, q, 2, joint)
    assert km.tokens is None and torch.equal(km.text, tm)
    assert check_key_mask(None, None, q, 2, joint) is None
    for bad in (m.float(), m[:, :5], m[:, None], m[:, None, None].expand(2, 2, 1, 6)):
        with pytest.raises(InputError):
            check_key_mask(bad, None, q, 2, None)
    with pytest.raises(InputError):
        check_key_mask(None, tm, q, 2, None)  # a text mask without text


def test_key_mask_chunk_is_the_ranks_columns():
    km = KeyMask(torch.arange(24).view(2, 12), 4)
    assert km.chunk(1).tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]
    assert km.chunk(2).tolist() == [[8, 9, 10, 11], [20, 21, 22, 23]]
    assert KeyMask(None, 4).chunk(0) is None


def test_split_heads_groups_consecutive_heads():
    x = t(2, 12, 3, 4)
    y = split_heads(x, 2, 3)  # [2, 3, B, h=2, S, D]
    assert y.shape == (2, 3, 2, 2, 3, 4)
    for a in range(2):
        for b in range(3):
            g = a * 3 + b
            assert torch.equal(y[a, b], x[:, 2 * g:2 * g + 2])
    y = split_heads(x, 4)  # one grid dimension: [4, B, 3, S, D]
    assert y.shape == (4, 2, 3, 3, 4)
    for a in range(4):
        assert torch.equal(y[a], x[:, 3 * a:3 * a + 3])


def test_repeat_and_grouped_kv_follow_repeat_interleave():
    k, v = t(2, 3, 4, 8), t(2, 3, 4, 8)
    assert torch.equal(repeat_heads(k, 2), k.repeat_interleave(2, dim=1))
    joint = Joint(t(2, 6, 5, 8), t(2, 3, 5, 8), t(2, 3, 5, 8), "front")
    k2, v2, j2 = grouped_kv(k, v, joint, 6, 2, "test")  # 3 K/V heads into 2 groups: lcm = 6
    assert torch.equal(k2, k.repeat_interleave(2, dim=1)) and torch.equal(v2, v.repeat_interleave(2, dim=1))
    assert torch.equal(j2.k, joint.k.repeat_interleave(2, dim=1)) and j2.q is joint.q
    k3, v3, j3 = grouped_kv(k, v, joint, 6, 3, "test")  # 3 groups divide 3 heads
    assert k3 is k and v3 is v and j3 is joint


def test_joint_head_group_splits_each_by_its_heads():
    joint = Joint(t(2, 4, 5, 8), t(2, 2, 5, 8), t(2, 2, 5, 8), "front")
    q, k, v = joint.head_group(1, 2)
    assert torch.equal(q, joint.q[:, 2:4]) and torch.equal(k, joint.k[:, 1:2]) and torch.equal(v, joint.v[:, 1:2])


@pytest.mark.parametrize("where", ["front", "rear", None])
@pytest.mark.parametrize("grid", [(2, 3), (6,)])
def test_gather_output_puts_head_groups_and_text_in_place(where, grid):
    B, h, S, Tj, D = 2, 2, 3, 2, 4
    o = Slots.alloc(lambda shape: torch.randn(shape), grid, B, h, S, Tj, D)
    assert hash(o) == hash(o)
    assert o.flat.shape == (*grid, Slots.numel(B, h, S, Tj, D)) == (*grid, B * h * (S + Tj) * D)
    joint = None if where is None else Joint(t(B, 12, Tj, D), t(B, 12, Tj, D), t(B, 12, Tj, D), where)
    out = gather_output(o, joint)
    groups = [(a, b) for a in range(2) for b in range(3)] if len(grid) == 2 else [(a,) for a in range(6)]
    rows = torch.cat([o.rows[g] for g in groups], 1)  # [B, H, S, D]
    text = torch.cat([o.text[g] for g in groups], 1)  # [B, H, Tj, D]
    want = torch.cat([text, rows] if where == "front" else [rows, text], 2)
    assert torch.equal(out, want)
    # the image rows of a slot are its prefix, the text the rest
    assert torch.equal(o.flat[groups[-1]][:B * h * S * D].view(B, h, S, D), o.rows[groups[-1]])
    with pytest.raises(ValueError):
        Slots.view(o.flat, B, h, S, Tj + 1, D)


def test_joint_and_key_mask_are_values():
    import dataclasses
    joint = Joint(t(1, 2, 3, 4), t(1, 2, 3, 4), t(1, 2, 3, 4), "front")
    assert hash(joint) == hash(joint) and hash(KeyMask(None, 4)) == hash(KeyMask(None, 4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        joint.strategy = "rear"
