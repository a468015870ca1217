"""Diagnostic for `shoal bench network --account-protocols`: counts a node's libp2p traffic by protocol.

Put this folder on PYTHONPATH and set SHOAL_WIRE_ACCOUNTING to a folder: every shoal process then counts the
bytes and writes of each libp2p stream protocol (above yamux), the streams it opened or accepted per protocol,
and the writes and bytes on its TCP sockets (below Noise), and rewrites <folder>/<pid>.json every second.
Measurement only: nothing of shoal reads it.
"""

import json
import os
import threading
import time

DIR = os.environ.get("SHOAL_WIRE_ACCOUNTING")
if DIR:
    from collections import defaultdict

    counts = defaultdict(lambda: [0, 0, 0, 0, 0])  # protocol -> [bytes out, writes, bytes in, reads, streams]
    tcp = [0, 0, 0, 0]  # bytes out, writes, bytes in, reads

    def _install():
        from libp2p.io.trio import TrioTCPStream
        from libp2p.network.stream.net_stream import NetStream

        w0, r0 = NetStream.write, NetStream.read

        async def write(self, data):
            c = counts[str(self.protocol_id)]
            c[0] += len(data)
            c[1] += 1
            if not getattr(self, "_acct_seen", False):
                self._acct_seen = True
                c[4] += 1
            return await w0(self, data)

        async def read(self, n=None):
            data = await r0(self, n)
            c = counts[str(self.protocol_id)]
            c[2] += len(data)
            c[3] += 1
            if not getattr(self, "_acct_seen", False):
                self._acct_seen = True
                c[4] += 1
            return data

        NetStream.write, NetStream.read = write, read
        tw, tr = TrioTCPStream.write, TrioTCPStream.read

        async def twrite(self, data):
            tcp[0] += len(data)
            tcp[1] += 1
            return await tw(self, data)

        async def tread(self, n=None):
            data = await tr(self, n)
            tcp[2] += len(data)
            tcp[3] += 1
            return data

        TrioTCPStream.write, TrioTCPStream.read = twrite, tread
        import struct

        from libp2p.stream_muxer.yamux.yamux import Yamux

        yw = Yamux._write_frame
        names = {0: "DATA", 1: "WINDOW_UPDATE", 2: "PING", 3: "GO_AWAY"}

        async def ywrite(self, data):
            if len(data) >= 12:
                _, typ, flags, _, length = struct.unpack(">BBHII", data[:12])
                key = f"yamux {names.get(typ, typ)}{' SYN' if flags & 1 else ''}{' FIN' if flags & 4 else ''}"
                c = counts[key]
                c[0] += len(data)
                c[1] += 1
            return await yw(self, data)

        Yamux._write_frame = ywrite

    def _dump():
        path = os.path.join(DIR, f"{os.getpid()}.json")
        while True:
            time.sleep(1.0)
            try:
                doc = {"time": time.time(), "tcp": tcp, "protocols": {k: v for k, v in list(counts.items())}}
                with open(path + ".tmp", "w") as f:
                    json.dump(doc, f)
                os.replace(path + ".tmp", path)
            except Exception:  # noqa: BLE001 - a diagnostic must never disturb the node
                pass

    try:
        _install()
        threading.Thread(target=_dump, name="wire-accounting", daemon=True).start()
    except Exception:  # noqa: BLE001 - libp2p absent (e.g. the hivemind venv): nothing to count
        pass
