"""Inter-machine path of the CPU one-sided backend: a proxy per rank over TCP.

NVSHMEM crosses machines through a proxy thread that turns put/get into network operations
(EFA / InfiniBand); ``ShmCommunicator`` does the same for peers on another (emulated)
machine, so those bytes cross the machine's real (possibly throttled, see ``netns.py``) link.

Every rank runs one ``ProxyServer``: an accept thread and one handler thread per incoming
connection, which serves ``GET`` from and applies ``PUT`` into this rank's symmetric buffers
(``storage_of(buffer_id)``), and records ``ARRIVE`` barrier counts and ``BYE``. The client
side (``Proxy``) holds, per remote peer, one eager control connection (barrier arrivals,
liveness) and one lazy data connection per transfer queue, used only by that queue's thread:
requests on one queue stay FIFO, like the local copies. A request is split in two
(``start`` sends it, the function it returns receives the reply), so the queue thread can
have several requests in flight (``shm._IN_FLIGHT``): the link does not idle for a round
trip between two transfers (at the request's turn in a busy reverse-direction queue).

Wire format: header ``!BIQ`` = (op, meta length, payload length), then meta (JSON: buffer id,
storage offset, sizes, strides, dtype of the symmetric view), then raw payload bytes (the view
made contiguous). ``PUT`` is acknowledged after it was applied (so quiet + barrier makes it
visible), ``GET`` is answered with ``DATA``; a failed request is answered with ``ERROR``.

Liveness: a peer's control connection ending without ``BYE`` means it died (the kernel closes
a killed process's sockets), after ``BYE`` that it closed its communicator.
"""
from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Callable

import torch

from ..comm.base import CommTimeout, PeerFailure
from ..log import get_logger

log = get_logger("xfuser_swiftfusion.comm")

_HEADER = struct.Struct("!BIQ")
HELLO, PUT, GET, ACK, DATA, ERROR, ARRIVE, BYE = range(8)
CONTROL = "ctl"
PROXY_ADDR_ENV = "SWIFTFUSION_PROXY_ADDR"


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:], len(buf) - got, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError("connection closed by the other side")
        got += n


def _recv_msg(sock: socket.socket, into: torch.Tensor | None = None) -> tuple[int, dict, torch.Tensor | None]:
    """One message; the payload lands in ``into`` (contiguous, right size) or a new uint8 tensor."""
    head = bytearray(_HEADER.size)
    _recv_exact(sock, memoryview(head))
    op, meta_len, payload_len = _HEADER.unpack(head)
    meta = bytearray(meta_len)
    _recv_exact(sock, memoryview(meta))
    payload = None
    if payload_len:
        payload = into if into is not None else torch.empty(payload_len, dtype=torch.uint8)
        _recv_exact(sock, _byte_view(payload))
    return op, json.loads(meta) if meta_len else {}, payload


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous ``t`` (any dtype, also bf16) without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _send_msg(sock: socket.socket, op: int, meta: dict | None = None,
              payload: torch.Tensor | None = None) -> None:
    raw = json.dumps(meta).encode() if meta else b""
    nbytes = payload.numel() * payload.element_size() if payload is not None else 0
    sock.sendall(_HEADER.pack(op, len(raw), nbytes) + raw)
    if nbytes:
        sock.sendall(_byte_view(payload))


def view_meta(buffer_id: int, view: torch.Tensor) -> dict:
    """What identifies ``view`` of a symmetric buffer on every rank."""
    return {"b": buffer_id, "o": view.storage_offset(), "s": list(view.shape),
            "t": list(view.stride()), "d": str(view.dtype).removeprefix("torch.")}


def _view_of(storage: torch.UntypedStorage, meta: dict) -> torch.Tensor:
    dtype = getattr(torch, meta["d"])
    return torch.empty(0, dtype=dtype).set_(storage, meta["o"], meta["s"], meta["t"])


class ProxyServer:
    """Serves this rank's symmetric buffers to remote peers; tracks their barrier arrivals."""

    def __init__(self, rank: int, world_size: int, addr: str,
                 storage_of: Callable[[int], torch.UntypedStorage]) -> None:
        self.rank, self._storage_of = rank, storage_of
        self.arrived = [0] * world_size         # ARRIVE counts per peer (written by handlers)
        self.state: dict[int, tuple[str, int]] = {}  # peer -> ("open"|"closed"|"died", pid)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server((addr, 0), backlog=64)
        self.address = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept, name=f"sf-proxy-r{rank}-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # listener closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"sf-proxy-r{self.rank}-serve").start()

    def _serve(self, conn: socket.socket) -> None:
        peer, channel = -1, ""
        try:
            op, meta, _ = _recv_msg(conn)
            if op != HELLO:
                raise ConnectionError(f"expected HELLO, got op {op}")
            peer, channel = meta["rank"], meta["channel"]
            if channel == CONTROL:
                self.state[peer] = ("open", meta["pid"])
            while True:
                op, meta, payload = _recv_msg(conn)
                if op == ARRIVE:
                    self.arrived[peer] = meta["count"]
                elif op == BYE:
                    self.state[peer] = ("closed", self.state[peer][1])
                elif op in (PUT, GET):
                    self._transfer(conn, op, meta, payload)
                else:
                    raise ConnectionError(f"unexpected op {op} from rank {peer}")
        except (OSError, ConnectionError, ValueError, KeyError):
            pass  # the peer went away (or sent garbage): its connection ends here
        finally:
            conn.close()
            if channel == CONTROL and self.state.get(peer, ("",))[0] == "open":
                self.state[peer] = ("died", self.state[peer][1])

    def _transfer(self, conn: socket.socket, op: int, meta: dict, payload: torch.Tensor | None) -> None:
        try:
            view = _view_of(self._storage_of(meta["b"]), meta)
            if op == PUT:
                if view.numel():
                    with torch.inference_mode():  # buffers may be inference tensors
                        view.copy_(payload.view(view.dtype).view(view.shape))
                reply: tuple = (ACK,)
            else:
                reply = (DATA, None, view.contiguous())
        except Exception as exc:  # reported to the requester, which raises it
            reply = (ERROR, {"error": f"rank {self.rank}: {type(exc).__name__}: {exc}"})
        _send_msg(conn, *reply)

    def close(self) -> None:
        try:  # wakes the accept thread (close alone leaves it blocked in accept on Linux)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class Proxy:
    """This rank's side of every inter-machine put/get/barrier arrival (one instance per rank)."""

    def __init__(self, rank: int, world_size: int, remote_peers: list[int], addr: str,
                 storage_of: Callable[[int], torch.UntypedStorage], timeout_s: float) -> None:
        self.rank, self.remote_peers, self.timeout_s = rank, remote_peers, timeout_s
        self.server = ProxyServer(rank, world_size, addr, storage_of)
        self._addrs: dict[int, tuple[str, int]] = {}
        self._socks: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def connect(self, addresses: list[tuple[str, int]]) -> None:
        """Open the control connection to every remote peer (after all servers listen)."""
        self._addrs = {p: tuple(addresses[p]) for p in self.remote_peers}
        for p in self.remote_peers:
            self._sock(CONTROL, p)

    def _sock(self, channel: str, peer: int) -> socket.socket:
        key = (channel, peer)
        sock = self._socks.get(key)
        if sock is None:
            sock = socket.create_connection(self._addrs[peer], timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_msg(sock, HELLO, {"rank": self.rank, "channel": channel, "pid": os.getpid()})
            with self._lock:
                self._socks[key] = sock
        return sock

    def _failed(self, peer: int, exc: BaseException) -> Exception:
        if isinstance(exc, socket.timeout):
            return CommTimeout(f"peer rank {peer} sent nothing for {self.timeout_s:.1f} s")
        return PeerFailure(f"connection to peer rank {peer} failed: {exc}")

    def _reply(self, sock: socket.socket, peer: int, into: torch.Tensor | None) -> torch.Tensor | None:
        """Receive the reply to the oldest request in flight on ``sock``; return its payload."""
        try:
            reply, info, data = _recv_msg(sock, into)
        except (OSError, ConnectionError) as exc:
            raise self._failed(peer, exc) from exc
        if reply == ERROR:
            raise RuntimeError(f"peer rank {peer} rejected the request: {info['error']}")
        return data

    def start(self, op: str, channel: str, peer: int, meta: dict,
              local: torch.Tensor) -> Callable[[], None]:
        """Send a ``"put"`` (``peer``'s symmetric view ``meta`` <- ``local``) or ``"get"``
        (``local`` <- that view) request on ``channel``; return the function that receives
        its reply and completes it (a put once the peer applied it). Replies on one channel
        come back in request order: call the returned functions in that order."""
        get = op == "get"
        into = local if get and local.is_contiguous() and local.numel() else None  # no copy
        try:
            sock = self._sock(channel, peer)
            _send_msg(sock, GET if get else PUT, meta, None if get else local.contiguous())
        except (OSError, ConnectionError) as exc:
            raise self._failed(peer, exc) from exc

        def finish() -> None:
            data = self._reply(sock, peer, into)
            if get and into is None and local.numel():
                local.copy_(data.view(local.dtype).view(local.shape))
        return finish

    def arrive(self, peer: int, count: int) -> None:
        """Tell ``peer`` I entered ``count`` barriers that include it."""
        try:
            _send_msg(self._sock(CONTROL, peer), ARRIVE, {"count": count})
        except OSError as exc:
            raise PeerFailure(f"connection to peer rank {peer} failed: {exc}") from exc

    def arrived(self, peer: int) -> int:
        """How many barriers including me ``peer`` has entered."""
        return self.server.arrived[peer]

    def peer_state(self, peer: int) -> tuple[str, int]:
        """``("open" | "closed" | "died" | "unknown", pid)`` of a remote peer."""
        return self.server.state.get(peer, ("unknown", 0))

    def close(self) -> None:
        """Say BYE to every peer, close my connections and stop serving (idempotent)."""
        with self._lock:
            socks, self._socks = self._socks, {}
        for (channel, _), sock in socks.items():
            if channel == CONTROL:
                try:
                    _send_msg(sock, BYE)
                except OSError:
                    pass
            sock.close()
        self.server.close()
