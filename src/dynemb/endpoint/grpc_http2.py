"""Unary gRPC calls over HTTP/2 as an asyncio protocol, on the event loop that runs it (no threads of its own).

grpcio's server answers on its own core threads and hands each call to the event loop through a poller thread: a
dozen context switches and 0.2-0.3 ms of CPU a call more than the HTTP endpoint (docs/benchmark-history.md, "gRPC
latency: where the time goes"). This is the part of HTTP/2 (RFC 9113) a unary gRPC call uses, written for that:

- the connection: the client's preface, SETTINGS (acknowledged; its window size and largest frame honoured), PING
  (acknowledged), GOAWAY both ways, RST_STREAM, PRIORITY ignored, unknown frames ignored (as the RFC asks);
- flow control: a large window announced up front (so a request of up to the largest message never waits for a
  WINDOW_UPDATE) and topped up as it is used; replies wait for the client's window when they do not fit it; a
  client that sends DATA beyond the window announced gets FLOW_CONTROL_ERROR (RFC 9113 6.9.1: RST_STREAM for a
  stream's window, GOAWAY for the connection's), as does a WINDOW_UPDATE past 2^31-1;
- limits: at most ``max_connections`` connections (more get SETTINGS and a GOAWAY, then are closed), a connection with
  no open stream for ``idle_timeout_s`` is sent GOAWAY and closed (gRPC's "max connection idle": a client reconnects
  at its next call), a call with no deadline must send its whole message within ``idle_timeout_s`` of its headers
  (else DEADLINE_EXCEEDED, so a stalled upload holds no stream for good), and a header list over
  SETTINGS_MAX_HEADER_LIST_SIZE (announced) fails its call with RESOURCE_EXHAUSTED (a header block the HPACK decoder
  must refuse outright closes the connection); a client that resets more than 100 calls before their answer, and more
  than it let be answered, is sent GOAWAY ENHANCE_YOUR_CALM (HTTP/2 "rapid reset"); the requests a connection holds
  unfinished are bounded (``max_buffered_bytes`` a connection, ``max_total_buffered_bytes`` for all: a client cannot
  park 256 streams of a whole message each), DATA past a bound resets its stream with REFUSED_STREAM;
- deadlines: ``grpc-timeout`` is honoured, from the call's HEADERS: a call whose deadline passes before its message
  is whole, or has passed when it is, is answered DEADLINE_EXCEEDED without running its handler; one whose
  deadline passes while it runs is answered DEADLINE_EXCEEDED at the deadline, its handler cancelled (waiting work
  it queued is then dropped, see :class:`~dynemb.endpoint.service.Batcher`);
- a request: HEADERS (+ CONTINUATION; HPACK decoded by the ``hpack`` package) and DATA up to END_STREAM, then the
  length-prefixed message (inflated when its ``grpc-encoding`` is gzip or deflate), handed to the handler of its
  ``:path``;
- a reply: HEADERS, one message in DATA, then trailers with ``grpc-status``/``grpc-message``, written in one
  ``transport.write`` when the window allows; an error is a trailers-only reply. Reply headers use no HPACK
  dynamic table, so they are constant bytes.

Not here: streaming calls (a second message on a stream is an error), server push, TLS (``dynemb serve`` listens on
loopback in plain text, as it did with grpcio).
"""

from __future__ import annotations

import asyncio
import re
import struct
import time
import zlib
from typing import Awaitable, Callable, Optional

try:
    import hpack
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb serve's gRPC endpoint needs hpack: pip install 'dynemb[serving]' ({exc})") from exc

__all__ = ["GrpcError", "Http2GrpcServer", "Handler", "STATUS"]

STATUS = {"OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
          "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
          "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
          "DATA_LOSS": 15, "UNAUTHENTICATED": 16}
"""gRPC status codes by name (as ``grpc.StatusCode`` names them)."""


class GrpcError(Exception):
    """A call answered with a gRPC status other than OK: ``code`` (a :data:`STATUS` name) and ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


Handler = Callable[[bytes, dict], Awaitable[bytes]]
"""``await handler(message, metadata) -> reply``: the serialized request message (bytes or a memoryview) and the
call's metadata (lower-case names, str values; binary ``-bin`` entries left out; read-only) to the serialized reply;
raise :class:`GrpcError` to fail."""

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# frame types
_DATA, _HEADERS, _PRIORITY, _RST, _SETTINGS, _PUSH, _PING, _GOAWAY, _WINDOW, _CONTINUATION = range(10)
# flags
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes (RFC 9113 section 7)
_NO_ERROR, _PROTOCOL_ERROR, _FLOW_CONTROL_ERROR, _FRAME_SIZE_ERROR, _COMPRESSION_ERROR = 0x0, 0x1, 0x3, 0x6, 0x9
_STREAM_CLOSED, _REFUSED_STREAM, _CANCEL, _ENHANCE_YOUR_CALM = 0x5, 0x7, 0x8, 0xB
_HEAD = struct.Struct(">HBBBI")  # a frame header: length (24 bits: 16 + 8), type, flags, stream id
_MAX_FRAME = 1 << 20  # the largest frame we accept (SETTINGS_MAX_FRAME_SIZE): a 256-row request in one DATA frame
_MAX_HEADER_BLOCK = 64 << 10  # a request's header block (HPACK-compressed, or decoded), larger closes the connection
_MAX_HEADER_LIST = 16 << 10  # SETTINGS_MAX_HEADER_LIST_SIZE: a call with a larger list is failed, the connection kept
_WINDOW_MAX = (1 << 31) - 1
_MAX_STREAMS = 256  # SETTINGS_MAX_CONCURRENT_STREAMS: each open stream may buffer a whole request
_RESETS = 100  # calls a client may reset unanswered beyond as many as were answered ("rapid reset", CVE-2023-44487)
_SWEEPS = 4  # idle sweeps a connection must stay idle for (Http2GrpcServer._sweep)
_TIMEOUT = re.compile(r"([0-9]{1,8})([HMSmun])")  # grpc-timeout: 1-8 digits and a unit (gRPC over HTTP/2)
_UNIT_S = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _timeout_s(value: str) -> Optional[float]:
    """Seconds of a ``grpc-timeout`` value (``"100m"``: 0.1), None when it is not one."""
    match = _TIMEOUT.fullmatch(value)
    return None if match is None else int(match[1]) * _UNIT_S[match[2]]


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out, value = bytearray((first | limit,)), value - limit
    while value >= 128:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding: no decoder state touched."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


# :status 200 is static table entry 8 (an indexed field); content-type is static entry 31 (name reference).
_REPLY_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(16, 7, 0) + b"application/grpc"
_OK_TRAILERS = _literal(b"grpc-status", b"0")
_ACCEPT_ENCODING = _literal(b"grpc-accept-encoding", b"identity,deflate,gzip")
_INFLATE_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def _percent(message: str) -> bytes:
    """``grpc-message``'s encoding: UTF-8, bytes outside printable ASCII and ``%`` percent-encoded."""
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode())


def _trailers(code: str, message: str) -> bytes:
    # an unknown name is still an answer (UNKNOWN): a KeyError here would leave the stream unanswered
    block = _literal(b"grpc-status", str(STATUS.get(code, STATUS["UNKNOWN"])).encode())
    return block + _literal(b"grpc-message", _percent(message)) if message else block


class _Stream:
    __slots__ = ("headers", "head_bytes", "head_flags", "data", "size", "window", "pending", "trailers", "task",
                 "closed", "received", "deadline", "timer")

    def __init__(self, window: int, received: int = 0) -> None:
        self.headers = None  # dict once the header block is decoded
        self.head_bytes = bytearray()  # the header block while CONTINUATION frames follow
        self.head_flags = 0  # the flags of the HEADERS frame that began the block
        self.data: list = []
        self.size = 0
        self.window = window  # what we may still send on it (the client's stream window)
        self.pending = b""  # reply DATA payload waiting for window
        self.trailers = b""  # sent once ``pending`` is out
        self.task: Optional[asyncio.Task] = None
        self.closed = False  # reset by the client, or answered
        self.received = received  # what the client may still send on it (the window we announced)
        self.deadline: Optional[float] = None  # the time.monotonic() of its grpc-timeout
        self.timer: Optional[asyncio.TimerHandle] = None  # answers DEADLINE_EXCEEDED at the deadline


class _Connection(asyncio.Protocol):
    """One client connection (see the module docstring)."""

    def __init__(self, server: "Http2GrpcServer") -> None:
        self.server = server
        self.transport: Optional[asyncio.Transport] = None
        self.chunks: list = []  # the start of a frame not yet whole
        self.chunked = 0  # their bytes
        self.need = 0  # the bytes that make it whole
        self.preface = False
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = _MAX_HEADER_BLOCK
        self.header_cache: dict[bytes, dict] = {}  # see _decode
        self.streams: dict[int, _Stream] = {}
        self.continuing = 0  # the stream whose header block is being continued, 0 if none
        self.last_stream = 0
        self.send_window = 65535  # the client's connection window
        self.initial_window = 65535  # the client's window for each new stream
        self.max_frame = 16384  # the largest frame the client takes
        self.received = 0  # DATA bytes received since our last connection WINDOW_UPDATE
        self.receive_window = server.connection_window  # what the client may still send on the connection
        self.going_away = self.refused = False
        self.resets = self.answered = 0  # calls the client reset before their answer; calls answered
        self.buffered = 0  # request bytes held by streams whose message is not whole yet
        self.used = True  # a stream was opened since the last idle sweep (Http2GrpcServer._sweep)
        self.idle_sweeps = 0  # sweeps in a row that found no stream open and none opened
        self.paused = False  # the transport's buffer is over its high-water mark: replies wait, reading stops

    # -- the connection ---------------------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.server.connections) >= self.server.max_connections:  # refused: the server preface, then GOAWAY
            self.going_away = self.refused = True
            debug = b"too many connections (max_connections %d)" % self.server.max_connections
            transport.write(_frame(_SETTINGS, 0, 0)
                            + _frame(_GOAWAY, 0, 0, struct.pack(">II", 0, _REFUSED_STREAM) + debug))
            # FIN after the GOAWAY, and what the client sends meanwhile read and dropped: closing with its preface
            # unread would reset the connection (RST), and a client may then lose the GOAWAY
            transport.write_eof()
            asyncio.get_running_loop().call_later(1.0, transport.close)
            return
        self.server.connections.add(self)
        settings = struct.pack(">HIHIHIHI", 0x3, _MAX_STREAMS,  # MAX_CONCURRENT_STREAMS: more are refused
                               0x4, self.server.stream_window,  # INITIAL_WINDOW_SIZE: a whole request
                               0x5, _MAX_FRAME,  # MAX_FRAME_SIZE: in few frames
                               0x6, _MAX_HEADER_LIST)  # MAX_HEADER_LIST_SIZE: larger calls are failed
        transport.write(_frame(_SETTINGS, 0, 0, settings)
                        + _frame(_WINDOW, 0, 0, struct.pack(">I", self.server.connection_window - 65535)))

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.server.buffered -= self.buffered  # the unfinished requests go with the connection
        self.buffered = 0
        for stream in self.streams.values():
            stream.closed = True
            if stream.timer is not None:
                stream.timer.cancel()
        self.streams.clear()
        self.transport = None

    def pause_writing(self) -> None:
        """The client does not read what we write: read nothing more from it (no new calls, no PINGs to answer)
        and keep replies in their streams until it does, so that what it sends cannot grow our buffers."""
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()
            self._flush_all()

    def close(self, error: int = _NO_ERROR, debug: bytes = b"") -> None:
        if self.transport is not None:
            self.transport.write(_frame(_GOAWAY, 0, 0, struct.pack(">II", self.last_stream, error) + debug))
            self.transport.close()

    def goaway(self, debug: bytes = b"") -> None:
        """No new calls on this connection (the server stops, or it was idle): the client opens none after the
        GOAWAY; the connection closes once the calls under way are answered."""
        self.going_away = True
        if self.transport is not None:
            self.transport.write(_frame(_GOAWAY, 0, 0, struct.pack(">II", self.last_stream, _NO_ERROR) + debug))
            if not self.streams:
                self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.chunks:  # a frame arriving in parts: joined once it is whole (not at every part: 8 MiB requests)
            self.chunks.append(data)
            self.chunked += len(data)
            if self.chunked < self.need:
                return
            data = b"".join(self.chunks)
            self.chunks, self.chunked = [], 0
        start, end = 0, len(data)
        if not self.preface:
            if end < 24:
                if not _PREFACE.startswith(data):
                    return self.close(_PROTOCOL_ERROR, b"not an HTTP/2 connection preface")
                self.chunks, self.chunked, self.need = [data], end, 24
                return
            if data[:24] != _PREFACE:
                return self.close(_PROTOCOL_ERROR, b"not an HTTP/2 connection preface")
            self.preface, start = True, 24
        need = 9
        while end - start >= 9:
            high, low, kind, flags, stream = _HEAD.unpack_from(data, start)
            length = high << 8 | low
            if length > _MAX_FRAME:
                return self.close(_FRAME_SIZE_ERROR, b"frame larger than SETTINGS_MAX_FRAME_SIZE")
            if end - start - 9 < length:
                need = 9 + length
                break
            payload = data[start + 9:start + 9 + length]
            start += 9 + length
            if self.continuing and kind != _CONTINUATION:
                return self.close(_PROTOCOL_ERROR, b"a header block was interrupted")
            if not self._frame(kind, flags, stream & 0x7FFFFFFF, payload) or self.transport is None:
                return
        if start < end:
            self.chunks, self.chunked, self.need = [data[start:]], end - start, need

    def _frame(self, kind: int, flags: int, stream_id: int, payload) -> bool:
        """Act on one frame; False when the connection was closed."""
        if kind == _DATA:
            return self._data(flags, stream_id, payload)
        if kind == _HEADERS or kind == _CONTINUATION:
            return self._headers(kind, flags, stream_id, payload)
        if kind == _SETTINGS:
            if flags & _ACK:
                return True
            if len(payload) % 6 or stream_id:
                self.close(_FRAME_SIZE_ERROR if stream_id == 0 else _PROTOCOL_ERROR, b"bad SETTINGS frame")
                return False
            for i in range(0, len(payload), 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == 0x4:
                    if value > _WINDOW_MAX:
                        self.close(_FLOW_CONTROL_ERROR, b"SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1")
                        return False
                    for stream in self.streams.values():
                        stream.window += value - self.initial_window
                        if stream.window > _WINDOW_MAX:  # RFC 9113 6.9.2
                            self.close(_FLOW_CONTROL_ERROR, b"SETTINGS_INITIAL_WINDOW_SIZE takes a window past 2^31-1")
                            return False
                    self.initial_window = value
                elif key == 0x5:
                    if not 1 << 14 <= value < 1 << 24:  # RFC 9113 6.5.2 (0 would hold every large reply forever)
                        self.close(_PROTOCOL_ERROR, b"SETTINGS_MAX_FRAME_SIZE outside [2^14, 2^24-1]")
                        return False
                    self.max_frame = value
            self.transport.write(_frame(_SETTINGS, _ACK, 0))
            self._flush_all()
            return True
        if kind == _PING:
            if not flags & _ACK:
                self.transport.write(_frame(_PING, _ACK, 0, bytes(payload)))
            return True
        if kind == _WINDOW:
            if len(payload) != 4:
                self.close(_FRAME_SIZE_ERROR, b"bad WINDOW_UPDATE frame")
                return False
            increment = struct.unpack_from(">I", payload)[0] & 0x7FFFFFFF
            if stream_id == 0:
                self.send_window += increment
                if increment == 0 or self.send_window > _WINDOW_MAX:  # RFC 9113 6.9, 6.9.1
                    self.close(_PROTOCOL_ERROR if increment == 0 else _FLOW_CONTROL_ERROR,
                               b"a connection WINDOW_UPDATE of 0" if increment == 0 else
                               b"a connection WINDOW_UPDATE past 2^31-1")
                    return False
                self._flush_all()
            elif stream_id in self.streams:
                stream = self.streams[stream_id]
                stream.window += increment
                if increment == 0 or stream.window > _WINDOW_MAX:  # a stream error: the connection goes on
                    self._reset(stream_id, stream, _PROTOCOL_ERROR if increment == 0 else _FLOW_CONTROL_ERROR)
                elif stream.pending or stream.trailers:
                    self._flush(stream_id, stream)
            return True
        if kind == _RST:
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                if not stream.closed:
                    self.resets += 1
                self._drop(stream)
                if self.resets > _RESETS and self.resets > self.answered:  # opening calls only to reset them
                    self.close(_ENHANCE_YOUR_CALM, b"too many calls reset before their answer")
                    return False
            return True
        if kind == _GOAWAY:
            self.going_away = True
            return True
        if kind == _PUSH:
            self.close(_PROTOCOL_ERROR, b"a client cannot push")
            return False
        return True  # PRIORITY, and frame types this side does not know: ignored, as RFC 9113 asks

    def _headers(self, kind: int, flags: int, stream_id: int, payload) -> bool:
        if kind == _CONTINUATION:
            if stream_id != self.continuing or stream_id == 0:
                self.close(_PROTOCOL_ERROR, b"CONTINUATION without its HEADERS")
                return False
            stream = self.streams[stream_id]
        else:
            if flags & _PADDED:
                if not self._padding_fits(payload):
                    return False
                payload = payload[1:len(payload) - payload[0]]
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            stream = self.streams.get(stream_id)
            if stream is None and 0 < stream_id <= self.last_stream:  # trailers of a call answered early
                stream = self.streams[stream_id] = _Stream(0)
                stream.headers, stream.closed = {}, True
            elif stream is None:
                if stream_id % 2 == 0:
                    self.close(_PROTOCOL_ERROR, b"a client's stream has an odd id")
                    return False
                self.last_stream, self.used = stream_id, True
                stream = self.streams[stream_id] = _Stream(self.initial_window, self.server.stream_window)
            if stream.headers is not None and not flags & _END_STREAM:
                self.close(_PROTOCOL_ERROR, b"HEADERS on an open stream")
                return False
            stream.head_flags = flags  # trailers (HEADERS on a stream already open) end it
        stream.head_bytes += payload
        if len(stream.head_bytes) > _MAX_HEADER_BLOCK:
            self.close(_ENHANCE_YOUR_CALM, b"header block too large")
            return False
        if not flags & _END_HEADERS:
            self.continuing = stream_id
            return True
        self.continuing = 0
        try:
            headers = self._decode(bytes(stream.head_bytes))
        except hpack.OversizedHeaderListError:  # decoding stopped half way: the decoder's state is lost
            self.close(_ENHANCE_YOUR_CALM, b"header list over %d bytes" % _MAX_HEADER_BLOCK)
            return False
        except Exception:  # noqa: BLE001 - hpack's errors: the decoder's state is lost, so is the connection
            self.close(_COMPRESSION_ERROR, b"bad HPACK header block")
            return False
        stream.head_bytes = bytearray()
        if headers is None:  # decoded (the HPACK state is whole) but over the limit announced: this call fails
            stream.headers = stream.headers or {}
            self._reply(stream_id, stream, None, _trailers(
                "RESOURCE_EXHAUSTED", f"a header list over SETTINGS_MAX_HEADER_LIST_SIZE ({_MAX_HEADER_LIST} bytes)"))
            if not flags & _END_STREAM and not stream.head_flags & _END_STREAM:
                self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _NO_ERROR)))
            return True
        if stream.headers is not None:  # the client's trailers: nothing in them for a unary call
            if stream.data is None and not stream.closed:  # a second end of the stream (half-closed remote)
                self._reset(stream_id, stream, _STREAM_CLOSED)
            else:
                self._end_stream(stream_id, stream)
            return True
        stream.headers = headers
        timeout = headers.get("grpc-timeout")
        if timeout is not None:
            seconds = _timeout_s(timeout)
            if seconds is None:
                early = _trailers("INTERNAL", f"grpc-timeout {timeout[:40]!r} is not a gRPC timeout (1 to 8 digits "
                                              "and a unit: H, M, S, m, u, n)")
                self._reply(stream_id, stream, None, early)
                if not stream.head_flags & _END_STREAM:
                    self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _NO_ERROR)))
                return True
            stream.deadline = time.monotonic() + seconds
        if len(self.streams) > _MAX_STREAMS:  # decoded all the same: the HPACK state is the connection's
            self.streams.pop(stream_id)
            self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _REFUSED_STREAM)))
            return True
        early = None  # a call answered before its message: the client may stop sending (RST_STREAM)
        if self.going_away:
            early = _trailers("UNAVAILABLE", "the server is shutting down")
        elif headers.get(":path") not in self.server.handlers:  # a streaming call among them: not served
            early = _trailers("UNIMPLEMENTED", f"method {headers.get(':path')!r} is not served by dynemb serve")
        if early is not None:
            self._reply(stream_id, stream, None, early)
            if not stream.head_flags & _END_STREAM:
                self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _NO_ERROR)))
        elif stream.head_flags & _END_STREAM:
            self._end_stream(stream_id, stream)
        if stream.deadline is not None and not stream.closed and stream.timer is None:
            # from the call's start: a request still arriving at its deadline is answered then too
            stream.timer = asyncio.get_running_loop().call_later(
                max(0.0, stream.deadline - time.monotonic()), self._expire, stream_id, stream)
        elif not stream.closed and stream.task is None and stream.data is not None and \
                self.server.idle_timeout_s is not None:
            # no deadline and the message still arriving: it must be whole within the idle time, else a client that
            # sends headers and stops would hold its stream (and its connection) for as long as it likes
            stream.timer = asyncio.get_running_loop().call_later(self.server.idle_timeout_s, self._stalled,
                                                                 stream_id, stream)
        return True

    def _stalled(self, stream_id: int, stream: _Stream) -> None:
        """A call with no deadline whose message was not whole within ``idle_timeout_s`` of its headers: answered
        DEADLINE_EXCEEDED, the client told to stop sending, its bytes given back."""
        stream.timer = None
        if stream.closed or stream.task is not None or stream.data is None or self.transport is None:
            return
        self._reply(stream_id, stream, None, _trailers(
            "DEADLINE_EXCEEDED", f"the request message was not whole within {self.server.idle_timeout_s:g} s of "
                                 "its headers (a call with no grpc-timeout gets the server's idle timeout)"))
        self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _NO_ERROR)))

    def _padding_fits(self, payload) -> bool:
        """Whether a PADDED frame's Pad Length byte is there and its padding shorter than the frame (RFC 9113 6.1,
        6.2: else a PROTOCOL_ERROR, and the connection is closed)."""
        if payload and payload[0] < len(payload):
            return True
        self.close(_PROTOCOL_ERROR, b"padding longer than its frame")
        return False

    def _decode(self, block: bytes) -> Optional[dict]:
        """The header block's fields, ``{name: value}`` (read-only: it may be shared by calls); None when the list
        is larger than the SETTINGS_MAX_HEADER_LIST_SIZE announced (RFC 9113 6.5.2 counts 32 bytes a field more).

        A client sends the same block call after call once its fields are in the HPACK dynamic table (all indexed
        fields, which leave the table as it is): such a block decodes to the same fields as long as the table does
        not change, so it is decoded once (hpack costs about 50 us a block), and the blocks kept are forgotten
        when a block changes the table.
        """
        cached = self.header_cache.get(block)
        if cached is not None:
            return cached
        table = self.decoder.header_table
        entries = table.dynamic_entries
        before = (len(entries), entries[0] if entries else None, table.maxsize)
        fields = self.decoder.decode(block, raw=True)
        if sum(32 + len(name) + len(value) for name, value in fields) > _MAX_HEADER_LIST:
            self.header_cache = {}  # the table may have changed
            return None
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in fields
                   if not name.endswith(b"-bin")}
        if len(entries) == before[0] and (entries[0] if entries else None) is before[1] and \
                table.maxsize == before[2]:  # the table did not change (a new entry is a new tuple at the front)
            if len(self.header_cache) < 64:
                self.header_cache[block] = headers
        elif self.header_cache:
            self.header_cache = {}
        return headers

    def _data(self, flags: int, stream_id: int, payload) -> bool:
        size = len(payload)  # padding included: all of a DATA frame is flow-controlled
        self.receive_window -= size
        if self.receive_window < 0:
            self.close(_FLOW_CONTROL_ERROR, b"DATA beyond the connection's flow-control window")
            return False
        self.received += size
        if self.received >= self.server.connection_window >> 1:
            self.transport.write(_frame(_WINDOW, 0, 0, struct.pack(">I", self.received)))
            self.receive_window += self.received
            self.received = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.headers is None or stream.closed:
            if stream_id > self.last_stream or stream_id == 0:
                self.close(_PROTOCOL_ERROR, b"DATA on a stream never opened")
                return False
            return True  # a stream we answered or that was reset: its window no longer matters
        if stream.data is None:  # after the client's END_STREAM (half-closed remote, RFC 9113 5.1)
            self._reset(stream_id, stream, _STREAM_CLOSED)
            return True
        stream.received -= size
        if stream.received < 0:  # the stream's window (never topped up: it holds a whole request)
            self._reset(stream_id, stream, _FLOW_CONTROL_ERROR)
            return True
        if flags & _PADDED:
            if not self._padding_fits(payload):
                return False
            payload = payload[1:size - payload[0]]
        server = self.server
        if self.buffered + len(payload) > server.max_buffered_bytes or \
                server.buffered + len(payload) > server.max_total_buffered_bytes:  # requests held, unfinished
            self._reset(stream_id, stream, _REFUSED_STREAM)  # unprocessed: a gRPC client may retry it
            return True
        stream.size += len(payload)
        self.buffered += len(payload)
        server.buffered += len(payload)
        if stream.size > self.server.max_message_bytes + 5:
            self._reply(stream_id, stream, None, _trailers(
                "RESOURCE_EXHAUSTED", f"a request message over {self.server.max_message_bytes} bytes"))
            self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _NO_ERROR)))
            return True
        if payload:
            stream.data.append(payload)  # bytes (a slice of what the socket gave)
        if flags & _END_STREAM:
            self._end_stream(stream_id, stream)
        return True

    # -- a call -----------------------------------------------------------------------------------------------------
    def _end_stream(self, stream_id: int, stream: _Stream) -> None:
        if stream.closed:
            self.streams.pop(stream_id, None)
            return
        headers = stream.headers
        data = stream.data[0] if len(stream.data) == 1 else b"".join(stream.data)
        stream.data = None
        if stream.deadline is None and stream.timer is not None:  # whole in time: the arrival timer is done
            stream.timer.cancel()
            stream.timer = None
        self._release(stream)
        handler = self.server.handlers[headers[":path"]]
        error = None
        if headers.get(":method") != "POST" or not headers.get("content-type", "").startswith("application/grpc"):
            error = ("INTERNAL", "a gRPC call is a POST of content-type application/grpc")
        elif len(data) < 5 or len(data) != 5 + int.from_bytes(data[1:5], "big"):
            error = ("UNIMPLEMENTED" if len(data) > 5 + int.from_bytes(data[1:5], "big") else "INTERNAL",
                     "a unary call sends exactly one length-prefixed message")
        if error is None:
            message = memoryview(data)[5:]  # protobuf parses a memoryview: no copy of the message
            if data[0]:
                encoding = headers.get("grpc-encoding", "identity")
                if encoding not in _INFLATE_WBITS:
                    error = ("UNIMPLEMENTED", f"grpc-encoding {encoding!r} is not supported (gzip, deflate)")
                else:
                    message, error = self._inflate(message, encoding)
        if error is None and stream.deadline is not None:
            # time.monotonic, not loop.time: uvloop's is the time its iteration began, to the millisecond
            left = stream.deadline - time.monotonic()
            if left <= 0:  # passed before it could start (its timer has not fired yet): no work for nobody
                error = ("DEADLINE_EXCEEDED", "the deadline (grpc-timeout) passed before the call started")
                if self.server.on_expired is not None:
                    self.server.on_expired(headers[":path"])
        if error is not None:
            trailers = _trailers(*error)
            if error[0] == "UNIMPLEMENTED":
                trailers += _ACCEPT_ENCODING
            return self._reply(stream_id, stream, None, trailers)
        stream.task = asyncio.ensure_future(self._call(stream_id, stream, handler, message, headers))

    def _expire(self, stream_id: int, stream: _Stream, cancel: bool = True) -> None:
        """The call's deadline passed before its answer: DEADLINE_EXCEEDED now, its handler cancelled, or (its
        request still arriving) the client told to stop sending."""
        stream.timer = None
        if stream.closed or self.transport is None:
            return
        self._reply(stream_id, stream, None, _trailers("DEADLINE_EXCEEDED", "the deadline (grpc-timeout) passed "
                                                                            "before the call was answered"))
        if stream.task is None:  # never started: counted here, as a failure of its route
            if stream.data is not None and self.transport is not None:
                self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", _NO_ERROR)))
            if self.server.on_expired is not None:
                self.server.on_expired(stream.headers.get(":path", ""))
        elif cancel:
            stream.task.cancel()

    def _release(self, stream: _Stream) -> None:
        """The stream's request bytes leave the connection's buffers (handed to its call, or dropped)."""
        self.buffered -= stream.size
        self.server.buffered -= stream.size
        stream.size = 0

    def _drop(self, stream: _Stream) -> None:
        """The stream is done with (reset): no answer, no timer, its handler cancelled."""
        self._release(stream)
        stream.closed = True
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.task is not None:
            stream.task.cancel()

    def _reset(self, stream_id: int, stream: _Stream, code: int) -> None:
        """A stream error (RFC 9113 5.4.2): RST_STREAM with ``code``; the connection goes on."""
        self.streams.pop(stream_id, None)
        self._drop(stream)
        self.transport.write(_frame(_RST, 0, stream_id, struct.pack(">I", code)))
        self._maybe_done()

    def _inflate(self, message: bytes, encoding: str):
        limit = self.server.max_message_bytes
        try:
            inflater = zlib.decompressobj(_INFLATE_WBITS[encoding])
            out = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            return None, ("INTERNAL", f"a {encoding} request message that does not inflate: {exc}")
        if len(out) > limit or inflater.unconsumed_tail:
            return None, ("RESOURCE_EXHAUSTED", f"a request message over {limit} bytes once inflated")
        return out, None

    async def _call(self, stream_id: int, stream: _Stream, handler: Handler, message: bytes, headers: dict) -> None:
        try:
            reply = await handler(message, headers)
        except GrpcError as exc:
            return self._reply(stream_id, stream, None, _trailers(exc.code, exc.message))
        except asyncio.CancelledError:
            return None
        except Exception as exc:  # noqa: BLE001 - a bug here must answer the call, and not end the connection
            return self._reply(stream_id, stream, None, _trailers("INTERNAL", f"{type(exc).__name__}: {exc}"))
        finally:
            if stream.timer is not None:
                stream.timer.cancel()
                stream.timer = None
        if stream.deadline is not None and time.monotonic() >= stream.deadline:
            # scored on the event loop's thread past the deadline (the timer could not fire meanwhile)
            return self._expire(stream_id, stream, cancel=False)
        self._reply(stream_id, stream, reply, _OK_TRAILERS)

    def _reply(self, stream_id: int, stream: _Stream, reply: Optional[bytes], trailers: bytes) -> None:
        """Answer the call: HEADERS, the message and trailers, or (``reply`` None) a trailers-only reply."""
        if stream.closed or self.transport is None:
            return
        stream.closed = True
        self.answered += 1
        if stream.size:  # answered before its request was whole
            self._release(stream)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if reply is None:
            self.streams.pop(stream_id, None)
            self.transport.write(_frame(_HEADERS, _END_HEADERS | _END_STREAM, stream_id, _REPLY_HEADERS + trailers))
            return self._maybe_done()
        head = _frame(_HEADERS, _END_HEADERS, stream_id, _REPLY_HEADERS)
        body = b"\x00" + len(reply).to_bytes(4, "big") + reply
        window = min(stream.window, self.send_window)
        if len(body) <= window and len(body) <= self.max_frame and not self.paused:  # usually: one write for all
            self.streams.pop(stream_id, None)
            self.send_window -= len(body)
            self.transport.write(head + _frame(_DATA, 0, stream_id, body)
                                 + _frame(_HEADERS, _END_HEADERS | _END_STREAM, stream_id, trailers))
            return self._maybe_done()
        self.transport.write(head)
        stream.pending, stream.trailers = body, trailers
        self._flush(stream_id, stream)

    def _flush(self, stream_id: int, stream: _Stream) -> None:
        """Send what the windows allow of the stream's pending reply, then its trailers."""
        out = []
        while stream.pending and not self.paused:
            n = min(len(stream.pending), stream.window, self.send_window, self.max_frame)
            if n <= 0:
                break
            out.append(_frame(_DATA, 0, stream_id, stream.pending[:n]))
            stream.pending = stream.pending[n:]
            stream.window -= n
            self.send_window -= n
        if not stream.pending and stream.trailers:
            out.append(_frame(_HEADERS, _END_HEADERS | _END_STREAM, stream_id, stream.trailers))
            stream.trailers = b""
            self.streams.pop(stream_id, None)
        if out and self.transport is not None:
            self.transport.write(b"".join(out))
        self._maybe_done()

    def _flush_all(self) -> None:
        for stream_id, stream in list(self.streams.items()):
            if stream.pending or stream.trailers:
                self._flush(stream_id, stream)

    def _maybe_done(self) -> None:
        if self.going_away and not self.streams and self.transport is not None:
            self.transport.close()


class Http2GrpcServer:
    """Unary gRPC handlers served on the running event loop (module docstring).

    Args:
        handlers: ``{":path": handler}``, e.g. ``{"/inference.GRPCInferenceService/ModelInfer": infer}``
            (:data:`Handler`); any other path is answered UNIMPLEMENTED.
        max_message_bytes: the largest request message (inflated); larger ones are answered RESOURCE_EXHAUSTED.
        max_connections: connections served at once; more are sent GOAWAY and closed as they come.
        idle_timeout_s: a connection with no call open this long is sent GOAWAY and closed, and a call with no
            deadline has this long to send its whole message (None: never).
        max_buffered_bytes: request bytes a connection may hold in calls whose message is not whole yet (default:
            4 whole messages); DATA past it resets its stream with REFUSED_STREAM, which a gRPC client may retry.
        max_total_buffered_bytes: the same for all connections together (default: 32 whole messages, at least
            256 MiB).
        on_expired: called with the ``:path`` of a call answered DEADLINE_EXCEEDED without running its handler
            (its deadline had passed when its message was whole), to count it.

    Raises:
        ValueError: ``max_connections`` < 1 or ``idle_timeout_s`` <= 0.
    """

    def __init__(self, handlers: dict[str, Handler], max_message_bytes: int = 8 << 20, *,
                 max_connections: int = 1024, idle_timeout_s: Optional[float] = 300.0,
                 max_buffered_bytes: Optional[int] = None, max_total_buffered_bytes: Optional[int] = None,
                 on_expired: Optional[Callable[[str], None]] = None) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 (or None: never), got {idle_timeout_s}")
        self.handlers, self.max_message_bytes = handlers, max_message_bytes
        self.max_connections, self.idle_timeout_s, self.on_expired = max_connections, idle_timeout_s, on_expired
        self.max_buffered_bytes = 4 * (max_message_bytes + 5) if max_buffered_bytes is None else max_buffered_bytes
        self.max_total_buffered_bytes = max(32 * (max_message_bytes + 5), 256 << 20) \
            if max_total_buffered_bytes is None else max_total_buffered_bytes
        self.buffered = 0  # request bytes all connections hold in unfinished calls
        self.sweeper: Optional[asyncio.TimerHandle] = None
        # a whole request (and its 5-byte prefix) fits the stream window: no WINDOW_UPDATE round trip in a call
        self.stream_window = min(_WINDOW_MAX, max(65535, max_message_bytes + 1024))
        self.connection_window = min(_WINDOW_MAX, max(4 * self.stream_window, 16 << 20))
        self.connections: set[_Connection] = set()
        self.server: Optional[asyncio.AbstractServer] = None

    async def start(self, sock) -> None:
        """Serve on the bound socket ``sock`` (listening starts here)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Connection(self), sock=sock)
        if self.idle_timeout_s is not None:
            self.sweeper = loop.call_later(self.idle_timeout_s / _SWEEPS, self._sweep)

    def _sweep(self) -> None:
        """Every ``idle_timeout_s / 4``: a connection that had no call open for 4 sweeps in a row (the idle time,
        give or take a sweep) is sent GOAWAY and closed; a client opens a new one for its next call."""
        for connection in list(self.connections):
            if connection.used or connection.streams:
                connection.used, connection.idle_sweeps = False, 0
            else:
                connection.idle_sweeps += 1
                if connection.idle_sweeps >= _SWEEPS and not connection.going_away:
                    connection.goaway(b"idle for %gs" % self.idle_timeout_s)
        if self.server is not None:
            self.sweeper = asyncio.get_running_loop().call_later(self.idle_timeout_s / _SWEEPS, self._sweep)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop listening, send GOAWAY on every connection, wait up to ``grace_s`` for calls under way, then drop
        the connections left."""
        if self.server is None:
            return
        if self.sweeper is not None:
            self.sweeper.cancel()
        self.server.close()
        for connection in list(self.connections):
            connection.goaway()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(self.connections):
            if connection.transport is not None:  # abort: close() would wait for a client that reads nothing
                connection.transport.abort()
        self.server = None
