"""Request/response over libp2p streams: one stream per call, msgpack bodies, size limits, per-call timeouts."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from shoal.protocol.errors import ProtocolError
from shoal.protocol.schema import WireRecord
from shoal.protocol.wire import pack, unpack
from shoal.swarm.net.framing import StreamClosed, close_quietly, exchange_failures, read_frame, write_frame
from shoal.swarm.net.host import SwarmHost
from shoal.swarm.net.penalty import Penalties

log = logging.getLogger(__name__)

RPC_PROTOCOL = "/shoal/rpc/1.0.0"
MAX_REQUEST_BYTES = 256 * 1024
MAX_RESPONSE_BYTES = 4 * 1024 * 1024

R = TypeVar("R", bound=WireRecord)
Handler = Callable[[str, Any], Awaitable[Any]]  # (caller peer id, request body) -> response body


class RpcError(RuntimeError):
    """A call failed: the peer answered with an error, sent garbage, timed out, or could not be reached."""


class BadRequest(ProtocolError):
    """Raised by a handler to reject a request as malformed (the caller is penalized)."""


def parse_body(cls: type[R], body: Any) -> R:
    """`cls.from_wire(body)` for a handler: a malformed body is the caller's fault (BadRequest, penalized)."""
    try:
        return cls.from_wire(body)
    except ProtocolError as e:
        raise BadRequest(str(e)) from e


class RpcServer:
    """`later`: method prefixes whose handlers this node registers only once it has started its part (the run's
    methods, "run."): a call that arrives before them (a restarted identity is called by honest peers at once) is
    answered "not ready" without a penalty. Any other unknown method is a bad request."""

    def __init__(self, sh: SwarmHost, penalties: Penalties, *, request_timeout_s: float = 10.0,
                 later: tuple[str, ...] = ()):
        self.sh = sh
        self.penalties = penalties
        self.request_timeout_s = request_timeout_s
        self.later = later
        self.handlers: dict[str, Handler] = {}
        sh.set_handler(RPC_PROTOCOL, self._serve)

    def register(self, method: str, handler: Handler) -> None:
        self.handlers[method] = handler

    async def _serve(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if self.penalties.is_banned(peer):
            await stream.reset()
            return
        try:
            with trio.fail_after(self.request_timeout_s):
                raw = await read_frame(stream, MAX_REQUEST_BYTES)
                self.sh.control_bytes[1] += len(raw)
                req = unpack(raw, max_bytes=MAX_REQUEST_BYTES)
                if not isinstance(req, dict) or not isinstance(req.get("m"), str):
                    raise BadRequest("request must be a map with a method name 'm'")
                handler = self.handlers.get(req["m"])
                if handler is None and req["m"].startswith(self.later):
                    handler = _not_ready
                if handler is None:
                    raise BadRequest(f"unknown method {req['m'][:40]!r}")
                try:
                    resp = {"ok": True, "b": await handler(peer, req.get("b"))}
                except BadRequest:
                    raise  # the caller's fault: penalized below
                except Exception as e:  # the handler's own failure (a ProtocolError too): never the caller's fault
                    log.warning("rpc %s from %s failed: %s: %s", req["m"], peer, type(e).__name__, e)
                    resp = {"ok": False, "e": f"{type(e).__name__}: {e}"[:300]}
                out = pack(resp)
                self.sh.control_bytes[0] += len(out)
                await write_frame(stream, out)
                await stream.close()
        except ProtocolError as e:
            self.penalties.penalize(peer, f"bad rpc request: {e}")
            try:
                await write_frame(stream, pack({"ok": False, "e": f"rejected: {e}"[:300]}))
                await stream.close()
            except Exception:  # noqa: BLE001 - the peer may be gone already
                await stream.reset()
        except (StreamClosed, trio.TooSlowError) as e:
            log.info("rpc stream from %s ended early: %s", peer, e)
            await stream.reset()


async def _not_ready(caller: str, body: Any) -> Any:
    raise RuntimeError("not ready: this node has not started that part yet")


async def call(sh: SwarmHost, peer_id: str, method: str, body: Any = None, *, timeout_s: float = 10.0,
               max_response_bytes: int = MAX_RESPONSE_BYTES) -> Any:
    """Call `method` on `peer_id`; raise RpcError on timeout, transport failure, a bad answer or a remote error
    (never anything else: a libp2p failure to open the stream is one of them)."""
    if peer_id == sh.peer_id:
        raise RpcError(f"{method}: refusing to call this node itself over the network")
    with exchange_failures(RpcError, f"{method} on {peer_id[:16]}…", timeout_s):
        stream = await sh.open_stream(peer_id, RPC_PROTOCOL)
        try:
            req = pack({"m": method, "b": body})
            sh.control_bytes[0] += len(req)
            await write_frame(stream, req)
            raw = await read_frame(stream, max_response_bytes)
            sh.control_bytes[1] += len(raw)
            resp = unpack(raw, max_bytes=max_response_bytes)
        finally:
            await close_quietly(stream)
    if not isinstance(resp, dict) or not isinstance(resp.get("ok"), bool):
        raise RpcError(f"{method} on {peer_id[:16]}…: malformed response")
    if not resp["ok"]:
        raise RpcError(f"{method} on {peer_id[:16]}…: {str(resp.get('e'))[:300]}")
    return resp.get("b")
