"""`python -m shoal.bench.natcheck`: one shoal host that reaches a peer the way NATed nodes do, timed.

Used by the NAT tests and `bench/bench_nat.py`, inside a namespace of the NAT topology. It joins the swarm,
learns its own reachability (and holds a relay when it needs one), reads the target's announcement from the
peer it joined, and then:
  reach  -- calls the target's `members` RPC (through the target's relay when it is relayed), then waits for a
            direct connection (the hole punch); prints {"relayed_rpc_s", "direct_s", "direct", ...} as JSON;
  flood  -- dials the target through `--via` (a relay) and pushes bulk data over a ping stream as fast as it
            can, circuit after circuit, for --seconds; prints how many bytes went out and came back.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shoal.protocol.envelope import open_envelope
from shoal.protocol.kinds import RECORD_TYPES
from shoal.protocol.records import Announcement
from shoal.swarm.net.host import HostConfig, open_host
from shoal.swarm.net.nat import NatConfig
from shoal.swarm.net.paths import NoDirectPath, PathConfig, connection_kinds
from shoal.swarm.net.relay import dial_via_relay
from shoal.swarm.net.rpc import call

log = logging.getLogger("natcheck")
PING = "/ipfs/ping/1.0.0"


async def _announcement_of(sh, source: str, target: str) -> Announcement:
    rows = await call(sh, source, "members", timeout_s=10)
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, list) and row and row[0]:
            try:
                rec = open_envelope(row[0], RECORD_TYPES).record
            except Exception:  # noqa: BLE001 - a bad row is skipped
                continue
            if isinstance(rec, Announcement) and rec.peer_id == target:
                return rec
    raise LookupError(f"{source} does not know {target}")


async def reach(sh, args, out: dict) -> None:
    from libp2p.peer.id import ID

    ann = await _announcement_of(sh, sh.config.join[0].rsplit("/p2p/", 1)[1], args.target)
    out["target_reachability"] = ann.reachability
    sh.nat.paths.learn(args.target, ann.reachability, ann.addrs)
    t0 = time.monotonic()
    await call(sh, args.target, "members", timeout_s=args.timeout)
    out["relayed_rpc_s"] = time.monotonic() - t0
    peer = ID.from_base58(args.target)
    out["first_path"] = "direct" if connection_kinds(sh.host, peer)[0] else "relayed"
    try:
        if out["first_path"] == "relayed":
            await sh.nat.paths.wait_direct(peer)
        out["direct"] = True
    except NoDirectPath as e:
        out["direct"], out["why"] = False, str(e)
    out["direct_s"] = time.monotonic() - t0
    stream = await sh.open_stream(args.target, PING, bulk=True) if out["direct"] else None
    if stream is not None:
        out["bulk_stream_path"] = "relayed" if "/p2p-circuit" in str(
            stream.muxed_conn.get_transport_addresses()) else "direct"
        await stream.reset()


async def _ping_stream_on(sh, conn):
    """A ping stream on exactly this connection (host.new_stream would pick the best one, maybe a direct one)."""
    from libp2p.custom_types import TProtocol
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator

    stream = await conn.new_stream()
    proto = await sh.host.multiselect_client.select_one_of([TProtocol(PING)], MultiselectCommunicator(stream), 10)
    stream.set_protocol(proto)
    return stream


async def flood(sh, args, out: dict) -> None:
    """Push ping payloads through the relay, circuit after circuit, counting what goes out and what echoes back."""
    payload = b"\x5a" * 65536
    sent = echoed = circuits = 0
    t_end = time.monotonic() + args.seconds
    errors: list[str] = []
    while time.monotonic() < t_end and circuits < 64:
        circuits += 1
        conn = None
        try:
            conn = await dial_via_relay(sh.host, f"{args.via}/p2p-circuit/p2p/{args.target}", 10)
            stream = await _ping_stream_on(sh, conn)

            async def drain() -> None:
                nonlocal echoed
                while True:
                    data = await stream.read(65536)
                    if not data:
                        return
                    echoed += len(data)

            with trio.move_on_after(max(0.1, t_end - time.monotonic())):
                async with trio.open_nursery() as n:
                    n.start_soon(drain)
                    while True:
                        await stream.write(payload)
                        sent += len(payload)
        except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - refused or cut by the relay: try again
            errors.append(f"{type(e).__name__}: {e}"[:120])
            await trio.sleep(0.1)
        finally:
            if conn is not None:
                with trio.move_on_after(2):
                    try:
                        await conn.close()
                    except Exception:  # noqa: BLE001
                        pass
    out.update(sent=sent, echoed=echoed, circuits=circuits, errors=errors[-5:])


async def main_async(args) -> dict:
    nat = NatConfig(paths=PathConfig(hole_punch=not args.no_hole_punch, punch_timeout_s=args.timeout))
    out: dict = {"mode": args.mode}
    async with open_host(Ed25519PrivateKey.generate(), HostConfig(listen=args.listen, join=tuple(args.join),
                                                                  nat=nat)) as sh:
        t0 = time.monotonic()
        joined = await sh.bootstrap()
        async with trio.open_nursery() as n:
            await sh.nat.settle(joined, 20)
            await n.start(sh.nat.run)
            out["me"], out["reachability"], out["settle_s"] = sh.peer_id, sh.nat.reachability, time.monotonic() - t0
            try:
                with trio.fail_after(args.timeout * 3 + args.seconds + 10):
                    await (reach if args.mode == "reach" else flood)(sh, args, out)
            except (Exception, trio.TooSlowError) as e:  # noqa: BLE001 - reported, not raised
                out["error"] = f"{type(e).__name__}: {e}"[:300]
            n.cancel_scope.cancel()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="natcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("reach", "flood"))
    p.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    p.add_argument("--join", action="append", required=True)
    p.add_argument("--target", required=True, help="peer id to reach")
    p.add_argument("--via", default=None, help="flood: the relay's address (with /p2p/)")
    p.add_argument("--seconds", type=float, default=5.0, help="flood: how long to push")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--no-hole-punch", action="store_true")
    p.add_argument("-v", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.v else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = trio.run(main_async, args)
    print(json.dumps(out), flush=True)
    return 0 if "error" not in out else 1


if __name__ == "__main__":
    sys.exit(main())
