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
(``start`` queues it, the function it returns receives the reply); ``flush`` sends what the
queue thread started, all requests for one connection in one ``sendmsg``, so requests the
strategy issued together reach the peer together and its handler answers them in one wakeup.

Wire format (little endian): a request is ``_REQ`` = (op, key length, payload length), the
key, the payload; a reply is ``_REPLY`` = (op, payload length), the payload. The key names
the peer's view: ``C`` + (buffer id, byte offset, byte count) for a contiguous view (served
straight from the mapping, no copy), ``S`` + (buffer id, storage offset, dtype index,
sizes, strides) for any other. ``PUT`` is acknowledged (``ACK``) after it was applied (so
quiet + barrier makes it visible), ``GET`` is answered with ``DATA``, a failed request with
``ERROR`` (payload: the message). Both ends read through a buffer (several small messages,
one ``recv``); payloads land straight in the destination's bytes.

Barrier arrivals go per machine: one ``ARRIVE`` to the lowest-numbered rank of the barrier on
each other machine carries (rank, count) for every rank of the barrier there; that rank's
handler writes them where those ranks read them (``on_arrive``, shared memory of the machine).

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


_REQ = struct.Struct("<BHQ")     # op, key length, payload length
_REPLY = struct.Struct("<BQ")    # op, payload length
_CONTIG = struct.Struct("<IQQ")  # buffer id, byte offset, byte count
_STRIDED = struct.Struct("<IqB")  # buffer id, storage offset, dtype index; then sizes, strides
HELLO, PUT, GET, ACK, DATA, ERROR, ARRIVE, BYE = range(8)
CONTROL = "ctl"
PROXY_ADDR_ENV = "SWIFTFUSION_PROXY_ADDR"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_INDEX = {d: i for i, d in enumerate(_DTYPES)}
_BUF = 1 << 16         # receive buffer per connection
_GATHER = 1 << 16      # reply bytes a handler holds back while more requests are buffered


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous ``t`` (any dtype, also bf16) without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """Writable bytes of ``storage`` (keeps it alive)."""
    return memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())


def view_key(buffer_id: int, view: torch.Tensor) -> bytes:
    """What identifies ``view`` of a symmetric buffer on every rank (the request's key)."""
    if view.is_contiguous():
        size = view.element_size()
        return b"C" + _CONTIG.pack(buffer_id, view.storage_offset() * size, view.numel() * size)
    try:
        dtype = _DTYPE_INDEX[view.dtype]
    except KeyError:
        raise ValueError(f"the proxy cannot move a strided {view.dtype} view") from None
    n = view.dim()
    return (b"S" + _STRIDED.pack(buffer_id, view.storage_offset(), dtype)
            + struct.pack(f"<{2 * n}q", *view.shape, *view.stride()))


class _Conn:
    """A socket with a receive buffer and a list of frames waiting to be sent.

    ``recv_*`` first send what is waiting (never block on reading with unsent output)."""

    __slots__ = ("sock", "_buf", "_mv", "_start", "_end", "out", "_out_bytes", "error")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray(_BUF)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0
        self.out: list = []
        self._out_bytes = 0
        self.error: BaseException | None = None  # a failed send: the stream is broken

    # -- sending ---------------------------------------------------------------------------

    def queue(self, *frames) -> None:
        self.out.extend(frames)
        self._out_bytes += sum(len(f) for f in frames)

    def flush(self) -> None:
        out, self.out, self._out_bytes = self.out, [], 0
        while out:
            sent = self.sock.sendmsg(out)
            while out and sent >= len(out[0]):
                sent -= len(out[0])
                out.pop(0)
            if sent:
                out[0] = memoryview(out[0])[sent:]

    @property
    def out_bytes(self) -> int:
        return self._out_bytes

    # -- receiving -------------------------------------------------------------------------

    def buffered(self) -> int:
        return self._end - self._start

    def _fill(self, need: int) -> None:
        """Have at least ``need`` (<= _BUF) bytes buffered."""
        if self._end - self._start >= need:
            return
        if self.out:
            self.flush()
        if self._start:  # move the rest to the front
            rest = self._end - self._start
            self._mv[:rest] = self._mv[self._start:self._end]
            self._start, self._end = 0, rest
        while self._end < need:
            n = self.sock.recv_into(self._mv[self._end:])
            if n == 0:
                raise ConnectionError("connection closed by the other side")
            self._end += n

    def recv_struct(self, fmt: struct.Struct) -> tuple:
        self._fill(fmt.size)
        out = fmt.unpack_from(self._buf, self._start)
        self._start += fmt.size
        return out

    def recv_bytes(self, n: int) -> bytes:
        if n <= _BUF:
            self._fill(n)
            out = bytes(self._mv[self._start:self._start + n])
            self._start += n
            return out
        out = bytearray(n)
        self.recv_into(memoryview(out))
        return bytes(out)

    def recv_into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes into ``dst``: the buffered ones, then straight from the socket."""
        have = min(len(dst), self._end - self._start)
        if have:
            dst[:have] = self._mv[self._start:self._start + have]
            self._start += have
        if have < len(dst):
            if self.out:
                self.flush()
            got, n = have, len(dst)
            while got < n:
                k = self.sock.recv_into(dst[got:], n - got, socket.MSG_WAITALL)
                if k == 0:
                    raise ConnectionError("connection closed by the other side")
                got += k

    def skip(self, n: int) -> None:
        while n:
            k = min(n, _BUF)
            self.recv_bytes(k)
            n -= k

    def close(self) -> None:
        self.sock.close()


def _control_frame(op: int, meta: bytes = b"") -> bytes:
    return _REQ.pack(op, len(meta), 0) + meta


class ProxyServer:
    """Serves this rank's symmetric buffers to remote peers; records barrier arrivals.

    ``on_arrive(sender, rank, count)``: ``sender`` entered ``count`` barriers including
    ``rank`` (a rank of this machine); ``on_bye(sender)``: ``sender`` closed (called after
    every ``on_arrive`` of its messages)."""

    def __init__(self, rank: int, addr: str, storage_of: Callable[[int], torch.UntypedStorage],
                 on_arrive: Callable[[int, int, int], None], on_bye: Callable[[int], None]) -> None:
        self.rank, self._storage_of = rank, storage_of
        self._on_arrive, self._on_bye = on_arrive, on_bye
        self.state: dict[int, tuple[str, int]] = {}  # peer -> ("open"|"closed"|"died", pid)
        self._conns: list[socket.socket] = []
        self._mem: dict[int, memoryview] = {}       # buffer id -> its bytes
        self._views: dict[bytes, object] = {}       # key -> bytes (contiguous) or tensor view
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
            threading.Thread(target=self._serve, args=(_Conn(conn),), daemon=True,
                             name=f"sf-proxy-r{self.rank}-serve").start()

    def _serve(self, conn: _Conn) -> None:
        peer, channel = -1, ""
        try:
            op, key_len, _ = conn.recv_struct(_REQ)
            if op != HELLO:
                raise ConnectionError(f"expected HELLO, got op {op}")
            hello = json.loads(conn.recv_bytes(key_len))
            peer, channel = hello["rank"], hello["channel"]
            if channel == CONTROL:
                self.state[peer] = ("open", hello["pid"])
            while True:
                if conn.out and (not conn.buffered() or conn.out_bytes > _GATHER):
                    conn.flush()  # nothing more to answer now (or enough held back)
                op, key_len, payload_len = conn.recv_struct(_REQ)
                if op in (PUT, GET):
                    self._transfer(conn, op, conn.recv_bytes(key_len), payload_len)
                elif op == ARRIVE:
                    pairs = struct.unpack(f"<{key_len // 8}q", conn.recv_bytes(key_len))
                    for i in range(0, len(pairs), 2):
                        self._on_arrive(peer, pairs[i], pairs[i + 1])
                elif op == BYE:
                    self._on_bye(peer)
                    self.state[peer] = ("closed", self.state[peer][1])
                else:
                    raise ConnectionError(f"unexpected op {op} from rank {peer}")
        except (OSError, ConnectionError, ValueError, KeyError, struct.error):
            pass  # the peer went away (or sent garbage): its connection ends here
        finally:
            conn.close()
            if channel == CONTROL and self.state.get(peer, ("",))[0] == "open":
                self.state[peer] = ("died", self.state[peer][1])

    def _view(self, key: bytes):
        """Contiguous: the view's bytes (memoryview); else the tensor view (cached by key)."""
        view = self._views.get(key)
        if view is None:
            if key[:1] == b"C":
                bid, off, n = _CONTIG.unpack_from(key, 1)
                mem = self._mem.get(bid)
                if mem is None:
                    mem = self._mem[bid] = storage_bytes(self._storage_of(bid))
                if off + n > len(mem):
                    raise ValueError(f"bytes {off}..{off + n} outside buffer {bid} ({len(mem)} bytes)")
                view = mem[off:off + n]
            else:
                bid, off, dtype = _STRIDED.unpack_from(key, 1)
                dims = struct.unpack_from(f"<{(len(key) - 1 - _STRIDED.size) // 8}q", key,
                                          1 + _STRIDED.size)
                n = len(dims) // 2
                view = torch.empty(0, dtype=_DTYPES[dtype]).set_(self._storage_of(bid), off,
                                                                 dims[:n], dims[n:])
            if len(self._views) > 4096:  # bounded: keys are few and repeat every layer
                self._views.clear()
            self._views[key] = view
        return view

    def _transfer(self, conn: _Conn, op: int, key: bytes, payload_len: int) -> None:
        try:
            view = self._view(key)
            nbytes = len(view) if isinstance(view, memoryview) else view.numel() * view.element_size()
            if op == PUT and payload_len != nbytes:
                raise ValueError(f"PUT of {payload_len} bytes into a view of {nbytes} bytes")
        except Exception as exc:  # reported to the requester, which raises it
            conn.skip(payload_len)
            self._error(conn, exc)
            return
        if op == PUT:
            if isinstance(view, memoryview):
                conn.recv_into(view)
            else:
                tmp = torch.empty(view.shape, dtype=view.dtype)
                conn.recv_into(_byte_view(tmp))
                with torch.inference_mode():  # buffers may be inference tensors
                    view.copy_(tmp)
            conn.queue(_REPLY.pack(ACK, 0))
        else:
            data = view if isinstance(view, memoryview) else _byte_view(view.contiguous())
            conn.queue(_REPLY.pack(DATA, len(data)), data)

    def _error(self, conn: _Conn, exc: BaseException) -> None:
        text = f"rank {self.rank}: {type(exc).__name__}: {exc}".encode()
        conn.queue(_REPLY.pack(ERROR, len(text)), text)

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
        self._views.clear()
        self._mem.clear()


class Proxy:
    """This rank's side of every inter-machine put/get/barrier arrival (one instance per rank).

    ``node_of[r]``: machine of rank ``r``; ``storage_of(buffer_id)``: my storage of a
    symmetric buffer; ``on_arrive``, ``on_bye``: see ``ProxyServer``."""

    def __init__(self, rank: int, node_of: list[int], addr: str,
                 storage_of: Callable[[int], torch.UntypedStorage],
                 on_arrive: Callable[[int, int, int], None], on_bye: Callable[[int], None],
                 timeout_s: float) -> None:
        self.rank, self.node_of, self.timeout_s = rank, node_of, timeout_s
        self.remote_peers = [p for p in range(len(node_of)) if node_of[p] != node_of[rank]]
        self.server = ProxyServer(rank, addr, storage_of, on_arrive, on_bye)
        self._storage_of = storage_of
        self._mem: dict[int, memoryview] = {}
        self._addrs: dict[int, tuple[str, int]] = {}
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._channels: dict[str, list[tuple[int, _Conn]]] = {}  # data connections by channel
        self._lock = threading.Lock()

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def connect(self, addresses: list[tuple[str, int]]) -> None:
        """Open the control connection to every remote peer (after all servers listen)."""
        self._addrs = {p: tuple(addresses[p]) for p in self.remote_peers}
        for p in self.remote_peers:
            self._conn(CONTROL, p)

    def _conn(self, channel: str, peer: int) -> _Conn:
        key = (channel, peer)
        conn = self._conns.get(key)
        if conn is None:
            sock = socket.create_connection(self._addrs[peer], timeout=self.timeout_s)
            sock.settimeout(None)  # blocking; the kernel times out (no poll per call)
            tv = struct.pack("ll", int(self.timeout_s), int(self.timeout_s % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = json.dumps({"rank": self.rank, "channel": channel, "pid": os.getpid()}).encode()
            sock.sendall(_control_frame(HELLO, hello))
            conn = _Conn(sock)
            with self._lock:
                self._conns[key] = conn
                self._channels.setdefault(channel, []).append((peer, conn))
        return conn

    def _failed(self, peer: int, exc: BaseException) -> Exception:
        if isinstance(exc, (socket.timeout, BlockingIOError)):  # SO_RCVTIMEO / SO_SNDTIMEO
            return CommTimeout(f"peer rank {peer} sent nothing for {self.timeout_s:.1f} s")
        return PeerFailure(f"connection to peer rank {peer} failed: {exc}")

    def local_bytes(self, buffer_id: int, view: torch.Tensor) -> memoryview:
        """The bytes of ``view``, a contiguous view of my symmetric buffer ``buffer_id``."""
        if not view.is_contiguous():
            raise ValueError("the local side of a proxy transfer must be contiguous")
        mem = self._mem.get(buffer_id)
        if mem is None:
            mem = self._mem[buffer_id] = storage_bytes(self._storage_of(buffer_id))
        size = view.element_size()
        off = view.storage_offset() * size
        return mem[off:off + view.numel() * size]

    def start(self, op: str, channel: str, peer: int, key: bytes,
              local: memoryview) -> Callable[[], None]:
        """Queue a ``"put"`` (``peer``'s symmetric view ``key`` <- ``local``) or ``"get"``
        (``local`` <- that view) request on ``channel``, to be sent by ``flush`` (or by the
        first reply awaited on that connection); return the function that receives its reply
        and completes it (a put once the peer applied it). Replies on one channel come back
        in request order: call the returned functions in that order."""
        get = op == "get"
        try:
            conn = self._conn(channel, peer)
        except OSError as exc:
            raise self._failed(peer, exc) from exc
        if get:
            conn.queue(_REQ.pack(GET, len(key), 0) + key)
        else:
            conn.queue(_REQ.pack(PUT, len(key), len(local)) + key, local)

        def finish() -> None:
            if conn.error is not None:
                raise self._failed(peer, conn.error) from conn.error
            try:
                reply, n = conn.recv_struct(_REPLY)
                if reply == DATA and get and n == len(local):
                    conn.recv_into(local)
                    return
                text = conn.recv_bytes(n).decode(errors="replace") if n else ""
            except (OSError, ConnectionError) as exc:
                raise self._failed(peer, exc) from exc
            if reply == ERROR:
                raise RuntimeError(f"peer rank {peer} rejected the request: {text}")
            if reply != (DATA if get else ACK):
                raise PeerFailure(f"peer rank {peer} answered op {reply} ({n} bytes) to a {op}")
        return finish

    def flush(self, channel: str) -> None:
        """Send every request started on ``channel`` (one ``sendmsg`` per connection); a
        connection that fails keeps its requests, whose ``finish`` then raises."""
        for peer, conn in self._channels.get(channel, ()):
            if conn.out:
                try:
                    conn.flush()
                except OSError as exc:
                    conn.error = exc

    def arrive(self, counts: dict[int, int]) -> None:
        """Tell every remote ``peer`` of ``counts`` that I entered ``counts[peer]`` barriers
        including it: one message per machine, to its lowest-numbered rank there."""
        by_machine: dict[int, list[int]] = {}
        for p in sorted(counts):
            by_machine.setdefault(self.node_of[p], []).append(p)
        for peers in by_machine.values():
            via = peers[0]  # its own count last: once it sees it, the others are written
            pairs = [x for p in (*peers[1:], via) for x in (p, counts[p])]
            try:
                conn = self._conn(CONTROL, via)
                conn.sock.sendall(_control_frame(ARRIVE, struct.pack(f"<{len(pairs)}q", *pairs)))
            except OSError as exc:
                raise PeerFailure(f"connection to peer rank {via} failed: {exc}") from exc

    def peer_state(self, peer: int) -> tuple[str, int]:
        """``("open" | "closed" | "died" | "unknown", pid)`` of a remote peer."""
        return self.server.state.get(peer, ("unknown", 0))

    def close(self) -> None:
        """Say BYE to every peer, close my connections and stop serving (idempotent)."""
        with self._lock:
            conns, self._conns, self._channels = self._conns, {}, {}
        for (channel, _), conn in conns.items():
            if channel == CONTROL:
                try:
                    conn.sock.sendall(_control_frame(BYE))
                except OSError:
                    pass
            conn.close()
        self._mem.clear()
        self.server.close()
