"""`shoal doctor --join`: whether a join address answers (TCP, then libp2p with its peer id), what it speaks, how
big its swarm is, and this machine's clock offset against the peers it reaches."""

from __future__ import annotations

import errno
import logging
import time

import multiaddr
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.node.doctor.checks import CLOCK_FIX, Check
from shoal.protocol.records import Announcement
from shoal.swarm.net.addresses import check_join_address
from shoal.swarm.net.host import HostConfig, SwarmHost, open_host
from shoal.swarm.net.membership import verified_members
from shoal.swarm.net.reachability import LAN, PUBLIC, UNKNOWN, UNREACHABLE
from shoal.swarm.net.rpc import RPC_PROTOCOL, RpcError, call

log = logging.getLogger(__name__)
CLOCK_OK_S, CLOCK_FAIL_S = 0.5, 5.0
TIME_SAMPLES = 3
IDENTIFY_WAIT_S = 2.0


def _parse(addr: str) -> tuple[str, int, str]:
    """(ip, port, peer id) of a /ip4/…/tcp/…/p2p/… address; ValueError otherwise."""
    check_join_address(addr)
    try:
        ma = multiaddr.Multiaddr(addr)
        return ma.value_for_protocol("ip4"), int(ma.value_for_protocol("tcp")), ma.value_for_protocol("p2p")
    except Exception as e:  # noqa: BLE001 - the multiaddr library raises several kinds
        raise ValueError(f"{addr}: doctor dials addresses of the form /ip4/IP/tcp/PORT/p2p/PEER_ID only "
                         f"({str(e).split(' (string:')[0]})") from None


def _causes(e: BaseException) -> str:
    """The messages along an exception's cause chain (py-libp2p wraps the real reason)."""
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(str(e) or type(e).__name__)
        inner = getattr(e, "exceptions", None)
        e = e.__cause__ or e.__context__ or (inner[0] if inner else None)
    return "; ".join(out)[:400]


async def _tcp_ms(ip: str, port: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    with trio.fail_after(timeout_s):
        stream = await trio.open_tcp_stream(ip, port)
    await stream.aclose()
    return (time.monotonic() - t0) * 1000


async def _protocols(sh: SwarmHost, peer_id: str) -> list[str]:
    """The protocols the peer listed in its identify message (arrives shortly after the connection)."""
    from libp2p.peer.id import ID

    deadline = trio.current_time() + IDENTIFY_WAIT_S
    while True:
        try:
            protos = list(sh.host.get_peerstore().get_protocols(ID.from_base58(peer_id)))
        except Exception:  # noqa: BLE001 - not in the peerstore yet
            protos = []
        if protos or trio.current_time() >= deadline:
            return sorted(str(p) for p in protos)
        await trio.sleep(0.05)


async def probe_join(sh: SwarmHost, addr: str, timeout_s: float) -> tuple[Check, list[Announcement]]:
    """One join address: TCP reachability, the libp2p dial (which proves the peer id), protocols, the swarm."""
    data: dict = {"addr": addr}
    try:
        ip, port, peer_id = _parse(addr)
    except ValueError as e:
        return Check(name="join", verdict="fail", summary=str(e), fix="copy the address a node prints at start "
                     "(shoal node prints it: ready; others join with: …)", data=data), []
    try:
        data["tcp_ms"] = round(await _tcp_ms(ip, port, timeout_s), 2)
    except trio.TooSlowError:
        return Check(name="join", verdict="fail", summary=f"{ip}:{port} does not answer within {timeout_s:g} s",
                     fix="check the IP, that the node runs, and that no firewall drops TCP port "
                         f"{port} on the way", data=data), []
    except OSError as e:
        why = _causes(e)  # trio wraps each attempt's error
        if "refused" in why.lower() or getattr(e.__cause__, "errno", None) == errno.ECONNREFUSED:
            why = "connection refused: nothing listens there"
        return Check(name="join", verdict="fail", summary=f"{ip}:{port}: {why}",
                     fix="start the node there (or fix the port: the node prints its address when ready)",
                     data=data), []
    t0 = time.monotonic()
    try:
        await sh.connect(addr)
    except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - every dial failure is the finding
        data.update(error=_causes(e), peer_id_match=False)
        return Check(name="join", verdict="fail",
                     summary=f"{ip}:{port} answers TCP in {data['tcp_ms']:.1f} ms, but the libp2p handshake as "
                             f"{peer_id[:16]}… fails: the node there has another peer id, or is not a shoal node",
                     fix="ask for the current address (a node's peer id changes if its identity file is lost)",
                     data=data), []
    data["dial_ms"] = round((time.monotonic() - t0) * 1000, 1)
    data["peer_id_match"] = True
    data["protocols"] = protos = await _protocols(sh, peer_id)
    peers: list[Announcement] = []
    try:
        rows = await call(sh, peer_id, "members", timeout_s=timeout_s)
        peers = [s.record for s, _ in verified_members(rows, lambda why: log.info("members: %s", why))
                 if isinstance(s.record, Announcement)]
    except RpcError as e:
        data["members_error"] = str(e)
    data["swarm_peers"] = len(peers)
    summary = (f"{ip}:{port} ({peer_id[:16]}…) answers: TCP {data['tcp_ms']:.1f} ms, libp2p {data['dial_ms']:.0f} ms, peer id matches; "
               f"a swarm of {len(peers)} node(s); speaks {', '.join(protos) or 'nothing it listed'}")
    if RPC_PROTOCOL not in protos:
        return Check(name="join", verdict="warn", summary=summary, data=data,
                     fix=f"the node does not list {RPC_PROTOCOL}: it is not a shoal node, or a much older one"), peers
    return Check(name="join", verdict="ok", summary=summary, data=data), peers


async def clock_offset(sh: SwarmHost, peer_id: str, timeout_s: float) -> tuple[float, float]:
    """(offset_s, rtt_s) against the peer's `time` RPC: the sample with the shortest round trip, NTP-style."""
    best: tuple[float, float] | None = None
    for _ in range(TIME_SAMPLES):
        t0 = time.time()
        remote = await call(sh, peer_id, "time", timeout_s=timeout_s)
        t1 = time.time()
        if isinstance(remote, bool) or not isinstance(remote, (int, float)):
            raise RpcError(f"time on {peer_id[:16]}…: not a number")
        sample = (float(remote) - (t0 + t1) / 2, t1 - t0)
        if best is None or sample[1] < best[1]:
            best = sample
    assert best is not None
    return best


async def check_clock(sh: SwarmHost, reached: list[str], others: list[Announcement], timeout_s: float,
                      max_peers: int) -> Check:
    """The clock offset against the joined peers and up to `max_peers` others of the swarm."""
    offsets: dict[str, dict] = {}
    targets = list(dict.fromkeys(reached))
    with trio.move_on_after(2 * timeout_s):  # the others are a bonus: their dials share one bounded wait
        for ann in others:
            if len(targets) >= max_peers:
                break
            if ann.peer_id in targets or ann.peer_id == sh.peer_id:
                continue
            for a in ann.addrs:
                try:
                    await sh.connect(a)
                    targets.append(ann.peer_id)
                    break
                except (Exception, trio.TooSlowError):  # noqa: BLE001 - unreachable from here: try the next address
                    continue
    for pid in targets:
        try:
            off, rtt = await clock_offset(sh, pid, timeout_s)
            offsets[pid] = {"offset_s": round(off, 4), "rtt_ms": round(rtt * 1000, 2)}
        except RpcError as e:
            log.info("no clock from %s: %s", pid, e)
    data = {"peers": offsets}
    if not offsets:
        return Check(name="clock", verdict="info", summary=f"none of the {len(targets)} peer(s) reached answered the "
                     "time query (shoal older than this one)", data=data)
    worst_pid = max(offsets, key=lambda p: abs(offsets[p]["offset_s"]))
    worst = offsets[worst_pid]["offset_s"]
    data["max_abs_offset_s"] = abs(worst)
    summary = (f"offset against {len(offsets)} peer(s): at most {worst:+.3f} s (vs {worst_pid[:16]}…, round trip "
               f"{offsets[worst_pid]['rtt_ms']:.1f} ms)")
    if abs(worst) < CLOCK_OK_S:
        return Check(name="clock", verdict="ok", summary=summary, data=data)
    why = " — the broker's lease expiry is read against this clock, so the node may take over or give up early"
    return Check(name="clock", verdict="warn" if abs(worst) < CLOCK_FAIL_S else "fail", summary=summary + why,
                 fix=CLOCK_FIX, data=data)


REACH_TEXT = {
    PUBLIC: ("ok", "public: peers anywhere can dial this machine at {at}; a node here relays for NATed peers by "
                   "default (--relay off to stop it)", ""),
    LAN: ("info", "lan: peers on this network dialed this machine back at {at}, but none from outside did",
          "peers elsewhere reach a node here through a relay and hole punching; to be dialable from anywhere, "
          "forward TCP port {port} on your router to this machine and run the node with --listen "
          "/ip4/0.0.0.0/tcp/{port}"),
    UNREACHABLE: ("warn", "behind a NAT: the peers tried to dial this machine back and could not",
                  "nothing to do for training: a node here reserves a relay and upgrades to direct connections by "
                  "hole punching; to be dialable, forward TCP port {port} on your router (or open it in the "
                  "firewall) and run the node with --listen /ip4/0.0.0.0/tcp/{port}"),
    UNKNOWN: ("info", "not known: no peer answered a dial-back request (old peers, or busy)",
              "run a node: it asks again every few minutes and prints its reachability"),
}


async def check_reachability(sh: SwarmHost, reached: list[str], port: int, timeout_s: float) -> Check:
    """Ask the reached peers to dial this machine back (a real dial from their side): public, same network only,
    or behind a NAT; and what that means for a node here."""
    from shoal.swarm.net.reachability import ask_dialback

    verdict = await ask_dialback(sh.nat.dialback, reached, list(sh.addrs), timeout_s)
    verdict_text, summary, fix = REACH_TEXT.get(verdict.reachability, REACH_TEXT[UNKNOWN])
    at = ", ".join(verdict.dialed_at) or "-"
    shown_port = port or 4001
    return Check(name="reachability", verdict=verdict_text, summary=summary.format(at=at),
                 fix=fix.format(port=shown_port), data={"reachability": verdict.reachability,
                                                         "dialed_at": list(verdict.dialed_at),
                                                         "answers": verdict.answers, "asked": reached[:3]})


async def check_join(addrs: list[str], *, timeout_s: float, max_peers: int = 8, listen_port: int = 0) -> list[Check]:
    """A Check per join address, then the clock and reachability Checks against the peers that answered (this
    machine listens on every interface for the dial-back, on the --listen port when it is free)."""
    from shoal.swarm.net.nat import NatConfig
    from shoal.swarm.net.relay import RelayConfig

    port = listen_port if listen_port and _port_free(listen_port) else 0
    config = HostConfig(listen=f"/ip4/0.0.0.0/tcp/{port}", dht_mode_server=False, connect_timeout_s=timeout_s,
                        nat=NatConfig(relay=RelayConfig(service="off")))
    async with open_host(Ed25519PrivateKey.generate(), config) as sh:
        checks, reached, others = [], [], []
        for addr in addrs:
            c, peers = await probe_join(sh, addr, timeout_s)
            checks.append(c)
            if c.data.get("peer_id_match"):
                reached.append(_parse(addr)[2])
                others += peers
        if reached:
            checks.append(await check_clock(sh, reached, others, timeout_s, max_peers))
            checks.append(await check_reachability(sh, reached, listen_port, timeout_s))
        return checks


def _port_free(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
