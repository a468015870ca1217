"""A stage's lane links (node/run/lanes.py): bytes stay counted across closed links."""

from __future__ import annotations

import trio

from shoal.node.run.lanes import StageLinks


class _End:
    """The counters a LinkEnd reports (bytes each way on each link) and its close."""

    def __init__(self, sent: int, recv: int):
        self.sent, self.recv, self.closed = sent, recv, False

    def counters(self):
        return {"b0/fwd": {"sent": {"wire_bytes": self.sent, "fp32_bytes": 2 * self.sent},
                           "recv": {"wire_bytes": self.recv, "fp32_bytes": 2 * self.recv}}}

    async def aclose(self):
        self.closed = True


def test_a_closed_links_bytes_stay_counted():
    links = StageLinks(None, None, None, "me", None)
    assert links.total_bytes() is None
    links.end = first = _End(100, 40)
    assert links.bytes() == (100, 40, 200)
    trio.run(links.close)
    assert first.closed and links.end is None
    assert links.bytes() == (100, 40, 200) and links.total_bytes() == (100, 40)  # never fewer than before
    links.end = second = _End(7, 3)
    assert links.bytes() == (107, 43, 214)
    trio.run(links.close)
    assert second.closed and links.bytes() == (107, 43, 214)
    trio.run(links.close)  # nothing open: nothing changes
    assert links.bytes() == (107, 43, 214)
