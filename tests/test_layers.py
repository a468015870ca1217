"""The import arrows of the design: protocol, kernels <- swarm <- node; tui -> protocol only; inside node, training
code knows no network and synchronizers know no runtime. Every module of every sub-folder is walked."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "protocol": set(),
    "kernels": set(),
    "swarm": {"protocol", "kernels"},
    "node": {"protocol", "kernels", "swarm"},
    "tui": {"protocol"},
}
# third-party imports a layer must not make (protocol stays free of torch and of the network stack)
FORBIDDEN_THIRD_PARTY = {"protocol": {"torch", "libp2p", "trio", "textual"}, "tui": {"torch", "libp2p", "trio"},
                         "kernels": {"libp2p", "trio", "textual"}, "node/train": {"trio", "libp2p"}}
# shoal packages a sub-folder must not import: the trainer runs without a network; synchronizers without a runtime
FORBIDDEN_SHOAL = {"node/train": ("shoal.swarm", "shoal.node.run", "shoal.node.sync.base", "shoal.node.cli"),
                   "node/sync": ("shoal.node.run", "shoal.node.cli")}


def imports(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            yield from ((a.name, n.lineno) for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            yield n.module, n.lineno


def test_import_arrows_point_one_way():
    bad = []
    for layer, allowed in ALLOWED.items():
        files = sorted((ROOT / layer).rglob("*.py"))
        assert files, f"layer {layer} has no modules"
        for f in files:
            for name, line in imports(ast.parse(f.read_text(encoding="utf-8"))):
                parts = name.split(".")
                if parts[0] == "shoal" and len(parts) > 1 and parts[1] != layer and parts[1] not in allowed:
                    bad.append(f"{f.relative_to(ROOT)}:{line}: {layer} imports {name}")
                if parts[0] in FORBIDDEN_THIRD_PARTY.get(layer, ()):
                    bad.append(f"{f.relative_to(ROOT)}:{line}: {layer} imports {name}")
    assert not bad, "\n".join(bad)


def test_inside_node_training_knows_no_network_and_sync_no_runtime():
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


def test_no_pickle_of_network_data():
    bad = []
    for layer in ("protocol", "swarm"):
        for f in sorted((ROOT / layer).rglob("*.py")):
            for name, line in imports(ast.parse(f.read_text(encoding="utf-8"))):
                if name.split(".")[0] in {"pickle", "dill", "cloudpickle", "marshal"}:
                    bad.append(f"{f.relative_to(ROOT)}:{line}: imports {name}")
    assert not bad, "\n".join(bad)
