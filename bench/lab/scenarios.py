"""Network scenarios as data files (scenarios/*.json): every node's link rates, for any node count.

A file holds `links` (every node's {up_mbit, down_mbit}, or null for unshaped), optional `overrides`
([{node, up_mbit, down_mbit}], negative node indices count from the end), or `dtfm` (a DT-FM case from
dtfm_sites.json, which keeps the bandwidth of every site pair of the paper's 64-device matrices) with `top_mbit`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from shoal.bench.topology import UNSHAPED, LinkShape

HERE = Path(__file__).resolve().parent
SCENARIO_DIR = HERE / "scenarios"
DTFM_FILE = HERE / "dtfm_sites.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    name: str
    description: str = ""
    links: LinkShape | None = None  # every node's link (None: unshaped)
    overrides: tuple[tuple[int, LinkShape], ...] = ()
    dtfm: str | None = None
    top_mbit: float = 100.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a scenario needs a name")
        if self.dtfm is not None and (self.links is not None or self.overrides):
            raise ValueError(f"{self.name}: dtfm scenarios take their rates from the DT-FM matrix only")
        if self.top_mbit <= 0:
            raise ValueError(f"{self.name}: top_mbit must be positive")

    @property
    def shaped(self) -> bool:
        return self.dtfm is not None or self.links is not None or bool(self.overrides)

    def shapes(self, nodes: int) -> list[LinkShape]:
        if self.dtfm is not None:
            return dtfm_shapes(self.dtfm, nodes, self.top_mbit)
        out = [self.links or UNSHAPED] * nodes
        for i, shape in self.overrides:
            if not -nodes <= i < nodes:
                raise ValueError(f"{self.name}: override for node {i} of {nodes}")
            out[i] = shape
        return out


def _shape(d: dict | None) -> LinkShape | None:
    if d is None:
        return None
    unknown = set(d) - {"up_mbit", "down_mbit", "node"}
    if unknown:
        raise ValueError(f"unknown link fields {sorted(unknown)}")
    return LinkShape(up_mbit=d.get("up_mbit"), down_mbit=d.get("down_mbit"))


def from_dict(d: dict) -> Scenario:
    unknown = set(d) - {"name", "description", "links", "overrides", "dtfm", "top_mbit"}
    if unknown:
        raise ValueError(f"scenario {d.get('name')!r}: unknown fields {sorted(unknown)}")
    overrides = tuple((int(o["node"]), _shape(o)) for o in d.get("overrides", ()))
    return Scenario(name=d["name"], description=d.get("description", ""), links=_shape(d.get("links")),
                    overrides=overrides, dtfm=d.get("dtfm"), top_mbit=float(d.get("top_mbit", 100.0)))


def available() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.json"))


def load(name_or_path: str) -> Scenario:
    """A scenario by name (scenarios/NAME.json) or by the path of a JSON file of the same form."""
    p = Path(name_or_path)
    if not p.suffix:
        p = SCENARIO_DIR / f"{name_or_path}.json"
    if not p.exists():
        raise ValueError(f"no scenario {name_or_path!r} (known: {', '.join(available())})")
    sc = from_dict(json.loads(p.read_text()))
    if sc.dtfm is not None:
        dtfm_shapes(sc.dtfm, 2, sc.top_mbit)  # the case exists
    return sc


def dtfm_devices(case: str, nodes: int) -> tuple[list[str], dict]:
    doc = json.loads(DTFM_FILE.read_text())["cases"]
    if case not in doc:
        raise ValueError(f"no DT-FM case {case!r} (known: {', '.join(doc)})")
    devices = doc[case]["devices"]
    chosen = [devices[k * len(devices) // nodes] for k in range(nodes)]  # spread over the sites, in order
    return chosen, doc[case]["site_gbps"]


def dtfm_shapes(case: str, nodes: int, top_mbit: float) -> list[LinkShape]:
    """Node i's link (both directions): its mean bandwidth to the other chosen devices, scaled so the fastest
    node's link is `top_mbit`."""
    sites, gbps = dtfm_devices(case, nodes)
    means = [statistics.fmean(gbps[a][b] for j, b in enumerate(sites) if j != i) for i, a in enumerate(sites)]
    scale = top_mbit / max(means)
    return [LinkShape(up_mbit=round(m * scale, 2), down_mbit=round(m * scale, 2)) for m in means]
