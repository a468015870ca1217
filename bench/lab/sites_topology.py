"""Nodes in sites: each site's nodes on a bridge of their own, every two sites joined by one link shaped by tbf both
ways, so links inside a site are fast and the link between two sites is slow (and can be throttled mid-run).

    node i [{p}n{i}] ──veth── {p}b{k} (site k's bridge) ──{p}x{k}{j}a ═ {p}x{k}{j}b── {p}b{j}    all in {p}sw

One /24 spans the sites (bridged, no routing). A node's own link can still be shaped per direction (`shape`, as in
`Topology`); `shape_between(k, j, mbit)` shapes the link between sites k and j (both directions). Teardown is
`Topology`'s: every namespace goes on leaving the `with` block, on an exception, at exit.
"""

from __future__ import annotations

import itertools

from shoal.bench.netns import run
from shoal.bench.topology import FRAME_BYTES, Topology, TopologyConfig, log


class SitesTopology(Topology):
    def __init__(self, config: TopologyConfig, sites: list[int]):
        if len(sites) != config.nodes or min(sites, default=0) < 0:
            raise ValueError(f"{len(sites)} site numbers for {config.nodes} nodes")
        super().__init__(config)
        self.sites = list(sites)
        self.site_count = max(sites) + 1
        self.between: dict[tuple[int, int], float | None] = {}

    def site_bridge(self, k: int) -> str:
        return f"{self.config.prefix}b{k}"

    def pair_ends(self, k: int, j: int) -> tuple[str, str]:
        """The veth ends of the link between sites k < j: on site k's bridge, on site j's."""
        return f"{self.config.prefix}x{k}{j}a", f"{self.config.prefix}x{k}{j}b"

    def _check(self) -> None:
        if self.site_count > 10:
            raise ValueError("at most 10 sites (interface names)")

    def _wire(self) -> None:
        """One bridge per site in the switch namespace, a veth between every two sites, each node on its site's."""
        c, sw = self.config, self.switch
        for k in range(self.site_count):
            br = self.site_bridge(k)
            run("ip", "-n", sw, "link", "add", br, "type", "bridge")
            run("ip", "-n", sw, "link", "set", br, "up")
        run("ip", "-n", sw, "addr", "add", f"{self.switch_ip}/24", "dev", self.site_bridge(0))
        frames = ("gso_max_size", str(FRAME_BYTES))
        for k, j in itertools.combinations(range(self.site_count), 2):
            a, b = self.pair_ends(k, j)
            run("ip", "-n", sw, "link", "add", a, "type", "veth", "peer", "name", b)
            run("ip", "-n", sw, "link", "set", a, *frames, "master", self.site_bridge(k), "up")
            run("ip", "-n", sw, "link", "set", b, *frames, "master", self.site_bridge(j), "up")
            self.between[(k, j)] = None
        for i in range(c.nodes):
            self._add_node(i, self.site_bridge(self.sites[i]))
        log.info("topology %s: %d namespaces in %d sites", self.config.prefix, self.config.nodes, self.site_count)

    def shape_between(self, k: int, j: int, mbit: float | None) -> None:
        """The link between sites k and j, both directions (None: unshaped)."""
        k, j = min(k, j), max(k, j)
        if (k, j) not in self.between:
            raise ValueError(f"no link between sites {k} and {j}")
        for end in self.pair_ends(k, j):
            self._tbf(self.switch, end, mbit)
        self.between[(k, j)] = mbit
