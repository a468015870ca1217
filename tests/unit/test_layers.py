"""The import arrows of the design: protocol, kernels <- swarm <- node <- bench; tui -> protocol only; inside swarm, a
run's control plane (run/) and a lane's data plane (lane/) know nothing of each other; inside node, training code
knows no network and synchronizers know no runtime; no two modules import each other, however indirectly. Every
module of every sub-folder is walked (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: package name (shoal.NAME) -> its folder in the repository
FOLDERS = {"protocol": "protocol", "kernels": "kernels", "swarm": "swarm", "node": "node", "tui": "tui",
           "bench": "bench/lab"}
ALLOWED = {
    "protocol": set(),
    "kernels": set(),
    "swarm": {"protocol", "kernels"},
    "node": {"protocol", "kernels", "swarm"},
    "tui": {"protocol"},
    # the benchmark lab sits above the product; only the `shoal bench` command loads it (by name, lazily)
    "bench": {"protocol", "kernels", "swarm", "node"},
}
# third-party imports a layer must not make (protocol stays free of torch and of the network stack)
FORBIDDEN_THIRD_PARTY = {"protocol": {"torch", "libp2p", "trio", "textual"}, "tui": {"torch", "libp2p", "trio"},
                         "kernels": {"libp2p", "trio", "textual"}, "node/train": {"trio", "libp2p"}}
# shoal packages a sub-folder must not import: the trainer runs without a network; synchronizers without a runtime;
# a run's control plane and a lane's data plane meet only in the node's runtime
FORBIDDEN_SHOAL = {"node/train": ("shoal.swarm", "shoal.node.run", "shoal.node.sync.base", "shoal.node.cli"),
                   "node/sync": ("shoal.node.run", "shoal.node.cli"),
                   "swarm/run": ("shoal.swarm.lane",), "swarm/lane": ("shoal.swarm.run",)}


def imports(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            yield from ((a.name, n.lineno) for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            yield n.module, n.lineno


def modules() -> dict[str, Path]:
    """Every shoal module by dotted name."""
    out = {}
    for name, folder in FOLDERS.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join(["shoal", name, *parts])] = f
    return out


def test_import_arrows_point_one_way():
    bad = []
    for layer, allowed in ALLOWED.items():
        files = sorted((ROOT / FOLDERS[layer]).rglob("*.py"))
        assert files, f"layer {layer} has no modules"
        for f in files:
            for name, line in imports(ast.parse(f.read_text(encoding="utf-8"))):
                parts = name.split(".")
                if parts[0] == "shoal" and len(parts) > 1 and parts[1] != layer and parts[1] not in allowed:
                    bad.append(f"{f.relative_to(ROOT)}:{line}: {layer} imports {name}")
                if parts[0] in FORBIDDEN_THIRD_PARTY.get(layer, ()):
                    bad.append(f"{f.relative_to(ROOT)}:{line}: {layer} imports {name}")
    assert not bad, "\n".join(bad)


def test_inside_node_and_swarm_sub_folders_keep_apart():
    bad = []
    for folder in sorted(set(FORBIDDEN_SHOAL) | {k for k in FORBIDDEN_THIRD_PARTY if "/" in k}):
        files = sorted((ROOT / folder).rglob("*.py"))
        assert files, f"{folder} has no modules"
        for f in files:
            for name, line in imports(ast.parse(f.read_text(encoding="utf-8"))):
                if name.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(folder, ()) or any(
                        name == p or name.startswith(p + ".") for p in FORBIDDEN_SHOAL.get(folder, ())):
                    bad.append(f"{f.relative_to(ROOT)}:{line}: {folder} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """No module reaches itself through imports (type-checking-only imports included): two files of one concept
    that import each other are one concept badly cut."""
    mods = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for m, f in mods.items():
        for name, _ in imports(ast.parse(f.read_text(encoding="utf-8"))):
            graph[m] |= {name} & mods.keys()
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):  # from PACKAGE import MODULE
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                graph[m] |= {f"{n.module}.{a.name}" for a in n.names} & mods.keys()
    graph = {m: deps - {m} for m, deps in graph.items()}
    cycles, state = [], {}  # state: 1 on the path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [m, d]) if d in path else f"{m} -> {d}")
            elif d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [])
    assert not cycles, "\n".join(cycles)


def test_no_pickle_of_network_data():
    bad = []
    for layer in ("protocol", "swarm"):
        for f in sorted((ROOT / layer).rglob("*.py")):
            for name, line in imports(ast.parse(f.read_text(encoding="utf-8"))):
                if name.split(".")[0] in {"pickle", "dill", "cloudpickle", "marshal"}:
                    bad.append(f"{f.relative_to(ROOT)}:{line}: imports {name}")
    assert not bad, "\n".join(bad)
