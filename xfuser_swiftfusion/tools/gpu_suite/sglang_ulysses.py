"""SGLang's pipelined Ulysses on rank 0 of one machine, on one GPU: a replay-stage row.

SGLang 0.5.23 pipelines ``USPAttention``'s Ulysses exchange over head groups
(``runtime/layers/attention/layer.py``: ``USPAttention._pipelined_ulysses``, the dense path of
``USPAttention.forward``; the work is ``IpcA2AMultiState.pipelined_attention`` in
``runtime/distributed/device_communicators/ipc_a2a_multi.py``, reached through
``ulysses_pipelined_attention``). It runs only where every Ulysses rank is on one host (the
transport maps peers' buffers over CUDA IPC: ``_member_devices`` refuses several hosts) and
the ring degree is 1 (``_pipelined_ulysses`` returns None otherwise), so on a cluster of several
machines it never runs; its place is one machine, Ulysses over its ``U`` GPUs. ``G`` head groups:
``$SGLANG_DIFFUSION_ULYSSES_PIPELINE_GROUPS``, or its automatic choice (``_auto_pipeline_groups``:
the most of 7, 5, 4, 3, 2 dividing the heads by ``U * G`` whose per-group call still fills 4
waves of 128-row tiles on the GPU's SMs; 0: no pipeline).

A call on rank ``r`` (q, k, v ``[B, S, H, D]`` shards; ``h = H / (U G)`` heads per group and
rank; head block ``(p, g)`` = heads ``[(p G + g) h, (p G + g + 1) h)``, group ``g`` of rank
``p``'s heads; replicated text rows, when the model passes them so, attended first):

1. on the caller's stream: this rank's own rows of every group into its receive slots, one
   pass per part (``copy_head_groups``), then its replicated rows (``place_replicated``);
2. on the copy stream, after the caller's stream: for each group ``g``, for each peer ``p``
   (``r + 1, r + 2, ...`` mod ``U``): v, q, k of head block ``(p, g)`` into ``p``'s slot ``g``
   at this rank's rows (``send_rows``: one pitched copy per batch row), then a flag per peer;
3. per group, on a stream of its own (after step 1): wait for every peer's flag of group ``g``,
   attend over slot ``g`` (``[B, rows, h, D]`` per part), then for each peer ``p`` the output
   rows of ``p``'s shard (and the replicated rows) into ``p``'s output block ``(r, g)``, a flag
   per peer, this rank's own rows into the merged output's heads ``(r, g)``, and for each peer
   ``p``: wait for its flag, copy its block ``(p, g)`` into the merged heads ``(p, g)``;
4. the caller's stream waits for every group stream and the copy stream.

On the replay's transport (one rank of a world that is not there, as ``ReplayComm``): a copy to
a peer goes to a scratch image of that peer's buffer that nothing reads; what peers write here
(their rows in this rank's slots, their output blocks) is in place before the call, from this
rank's own data (as ``ReplayComm`` serves a get from any peer); the flags have no peer to wait
for. SGLang's pitched copies (``cuMemcpy2DAsync`` on the copy engine) are ``Tensor.copy_`` on
strided views on the same streams; ``copy_head_groups`` (an SM kernel) is a ``copy_`` of the
same views. The attention op is one SGLang pipelines with (FA on Hopper, cuDNN SDPA on
Blackwell: ``PIPELINED_ATTENTION_BACKENDS``; flash-attn or cuDNN here, the CPU op on stand-ins).
Not replayed: the first call's check against the sequential exchange (once per shape), FA4's
``attend_into`` (Blackwell: attention straight into a token-major buffer), a QK-norm ``fill``.
On CPU the streams are one and the steps run in the order above.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

# (q, k, v [B, H, L, D], scale) -> (out [B, H, Lq, D], ...)
from .usp_layer import AttnOp

AUTO_GROUPS = (7, 5, 4, 3, 2)   # ipc_a2a_multi._AUTO_PIPELINE_GROUPS
MIN_GROUP_WAVES = 4             # ipc_a2a_multi._MIN_GROUP_WAVES
GROUPS_ENV = "SGLANG_DIFFUSION_ULYSSES_PIPELINE_GROUPS"


def auto_groups(heads: int, world: int, batch: int, rows: int, sms: int | None) -> int:
    """``_auto_pipeline_groups``: the most head groups whose calls still fill ``sms`` SMs
    (4 waves of 128-row tiles per call), or 0 for none (no pipeline)."""
    tiles = batch * -(-rows // 128)
    for n in AUTO_GROUPS:
        split = world * n
        if heads % split == 0 and (sms is None or heads // split * tiles >= MIN_GROUP_WAVES * sms):
            return n
    return 0


def groups_for(heads: int, world: int, batch: int, rows: int, device: torch.device
               ) -> tuple[int, str]:
    """(head groups the row runs, how chosen): ``$SGLANG_DIFFUSION_ULYSSES_PIPELINE_GROUPS``
    where set to more than 1, else SGLang's automatic choice on this GPU; where that is 0 (SGLang
    would not pipeline), the most of its candidates that divide the heads, said so."""
    env = int(os.environ.get(GROUPS_ENV, "-1"))
    if env > 1:
        return env, f"{GROUPS_ENV}={env}"
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else None)
    n = auto_groups(heads, world, batch, rows, sms)
    if n:
        return n, "SGLang's automatic choice" + ("" if sms else " (no SM floor on CPU)")
    forced = auto_groups(heads, world, batch, rows, None)
    return forced, (f"SGLang's automatic choice is 0 here (calls of {heads // max(1, world * forced)} "
                    f"heads fill fewer than {MIN_GROUP_WAVES} waves of {sms} SMs: it would not "
                    f"pipeline); {forced} groups, the most that divide the heads")


@dataclass
class PipelinedUlysses:
    """Rank ``rank`` of SGLang's pipelined Ulysses over ``world`` ranks (module docstring):
    ``q, k, v`` ``[B, S, H, D]`` (this rank's shard), ``replicated`` ``[B, T, H, D]`` text rows
    per part (or None), ``groups`` head groups, ``op`` the attention call. Built by
    ``build_pipelined_ulysses``; calling it returns ``[B, T + S, H, D]`` (text rows first)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    replicated: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    world: int
    groups: int
    scale: float
    op: AttnOp
    rank: int = 0
    streams: bool | None = None  # SGLang's streams and events (default: on CUDA)

    def __post_init__(self) -> None:
        B, S, H, D = self.q.shape
        U, G = self.world, self.groups
        if G < 1 or H % (U * G):
            raise ValueError(f"SGLang's pipelined Ulysses: {H} heads do not split over "
                             f"Ulysses {U} x {G} head groups")
        self.h = H // (U * G)
        self.T = 0 if self.replicated is None else self.replicated[0].shape[1]
        self.rows = self.T + U * S
        self.peers = [(self.rank + step) % U for step in range(1, U)]
        dev, dt = self.q.device, self.q.dtype
        # this rank's receive slots, one buffer as SGLang's pool lays them out: group-major,
        # part after part, each [B, rows, h, D] (``_PipelineSlots``); scratch images of the
        # peers' slots (what this rank's sends write; nothing reads them); output blocks from
        # the peers, and scratch images of this rank's blocks in the peers' buffers
        self.slot_numel = B * self.rows * self.h * D
        self.inb = torch.zeros(G * 3 * self.slot_numel, device=dev, dtype=dt)
        self.slots = [[self.inb[(g * 3 + part) * self.slot_numel:(g * 3 + part + 1) * self.slot_numel]
                       .view(B, self.rows, self.h, D) for part in range(3)] for g in range(G)]
        self.peer_slots = {p: [[torch.empty_like(s) for s in parts] for parts in self.slots]
                           for p in self.peers}
        out_rows = self.T + S
        self.out_blocks = {p: [torch.zeros(B, out_rows, self.h, D, device=dev, dtype=dt)
                               for _ in range(G)] for p in self.peers}
        self.peer_out_blocks = {p: [torch.empty_like(b) for b in self.out_blocks[p]]
                                for p in self.peers}
        self._peers_write()
        self.cuda = dev.type == "cuda" if self.streams is None else self.streams
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(dev)
            self.group_streams = [torch.cuda.Stream(dev) for _ in range(G)]

    # -- what the peers write here (before the call: no peer runs on this GPU) --------------

    def head_block(self, p: int, g: int) -> slice:
        start = (p * self.groups + g) * self.h
        return slice(start, start + self.h)

    def shard_row(self, p: int) -> int:
        return self.T + p * self.q.shape[1]

    def _peers_write(self) -> None:
        """Each peer's rows of this rank's heads in this rank's slots, and each peer's output
        block for this rank: from this rank's own data (each peer holds what this rank holds,
        as ``ReplayComm`` serves a get from any peer)."""
        S = self.q.shape[1]
        for g in range(self.groups):
            heads = self.head_block(self.rank, g)
            for part, x in enumerate((self.q, self.k, self.v)):
                for p in self.peers:
                    self.slots[g][part][:, self.shard_row(p):self.shard_row(p) + S] = x[:, :, heads]

    def fill_peer_outputs(self, full: torch.Tensor) -> None:
        """Peers' output blocks from ``full`` ``[B, T + S, H, D]`` (this rank's rows, every
        head): what each peer ``p`` sends for its heads ``(p, g)`` (zeros otherwise)."""
        for p in self.peers:
            for g in range(self.groups):
                self.out_blocks[p][g].copy_(full[:, :, self.head_block(p, g)])

    # -- the call (module docstring, steps 1-4) ------------------------------------------------

    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def _event(self, stream):
        """An event recorded on ``stream`` (None without streams)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def __call__(self) -> torch.Tensor:
        B, S, H, D = self.q.shape
        U, G, h, T, r = self.world, self.groups, self.h, self.T, self.rank
        parts = (self.q, self.k, self.v)
        main = torch.cuda.current_stream() if self.cuda else None
        ready = self._event(main)
        mine = self.shard_row(r)
        # 1. own rows of every group, one pass per part; then the replicated rows
        for part, x in enumerate(parts):  # copy_head_groups: [G, B, S, h * D] views
            own = x[:, :, (r * G) * h:(r * G + G) * h].unflatten(2, (G, h)).flatten(3)
            dst = self.inb.as_strided((G, B, S, h * D),
                                      (3 * self.slot_numel, self.rows * h * D, h * D, 1),
                                      part * self.slot_numel + mine * h * D)
            dst.copy_(own.permute(2, 0, 1, 3))
        if T:
            for g in range(G):
                heads = self.head_block(r, g)
                for part in range(3):
                    self.slots[g][part][:, :T] = self.replicated[part][:, :, heads]
        placed = self._event(main)
        # 2. the sends: per group, per peer, v then q then k (the flags: no peer to signal)
        if self.cuda:
            self.copy_stream.wait_event(ready)
        with self._stream(self.copy_stream if self.cuda else None):
            for g in range(G):
                for p in self.peers:
                    for part in (2, 0, 1):
                        self.peer_slots[p][g][part][:, mine:mine + S].copy_(
                            parts[part][:, :, self.head_block(p, g)])
        # 3. per group: attend, send the peers' rows, merge own and received blocks
        merged = torch.empty(B, T + S, H, D, device=self.q.device, dtype=self.q.dtype)
        done = []
        for g in range(G):
            stream = self.group_streams[g] if self.cuda else None
            if self.cuda:
                stream.wait_event(placed)
            with self._stream(stream):
                qs, ks, vs = (t.transpose(1, 2) for t in self.slots[g])  # [B, h, rows, D] views
                out = self.op(qs, ks, vs, self.scale)[0].transpose(1, 2).contiguous()
                for p in self.peers:
                    block = self.peer_out_blocks[p][g]
                    block[:, T:].copy_(out[:, self.shard_row(p):self.shard_row(p) + S])
                    if T:
                        block[:, :T].copy_(out[:, :T])
                own_heads = self.head_block(r, g)
                merged[:, T:, own_heads].copy_(out[:, mine:mine + S])
                if T:
                    merged[:, :T, own_heads].copy_(out[:, :T])
                for p in self.peers:
                    merged[:, :, self.head_block(p, g)].copy_(self.out_blocks[p][g])
                if self.cuda:
                    done.append(self._event(stream))
        # 4. the caller's stream joins every group stream and the copy stream
        if self.cuda:
            for event in done:
                main.wait_event(event)
            main.wait_stream(self.copy_stream)
        return merged


def build_pipelined_ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            joint: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                            world: int, groups: int, scale: float, op: AttnOp
                            ) -> PipelinedUlysses:
    """From the replay's ``[1, H, S, D]`` tensors (text ``[1, H, T, D]``): SGLang passes
    ``[B, S, H, D]``, so they are laid out that way once, outside the call."""
    bshd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    rep = None if joint is None else tuple(bshd(x) for x in joint)
    return PipelinedUlysses(bshd(q), bshd(k), bshd(v), rep, world, groups, scale, op)


__all__ = ["AUTO_GROUPS", "GROUPS_ENV", "PipelinedUlysses", "auto_groups",
           "build_pipelined_ulysses", "groups_for"]
