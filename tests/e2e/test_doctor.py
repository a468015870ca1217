"""`shoal doctor` on this machine, against a live node, and against join addresses that do not answer; the pieces it
and the compose image rely on (`shoal health`, join files, wildcard addresses)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.node.cli.health import verdict
from shoal.node.cli.joinfile import expand_join, read_join_file, write_address_file
from shoal.node.doctor.checks import libp2p_fix
from shoal.node.doctor.fit import fit, num_params
from shoal.swarm.net.addresses import expand_wildcard, scope
from shoal.swarm.net.identity import load_or_create_identity, peer_id_of

SHOAL = [sys.executable, "-m", "shoal.node.cli"]
PEER = "12D3KooWJNHMjwbG7TLWUw8icoPwNnqjcgwPBBq5or4nMrUmHYkF"


def doctor(home: Path, *args: str, env: dict | None = None, timeout_s: float = 120) -> tuple[int, dict]:
    r = subprocess.run([*SHOAL, "doctor", "--json", *args], capture_output=True, text=True, timeout=timeout_s,
                       env={**os.environ, "SHOAL_HOME": str(home), **(env or {})})
    assert r.stdout, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] == (r.returncode == 0), doc
    return r.returncode, {c["name"]: c for c in doc["checks"]}


def test_the_checklist_on_this_machine(tmp_path):
    import torch

    key = tmp_path / "home" / "identity.key"
    peer_id = peer_id_of(load_or_create_identity(key))
    code, by = doctor(tmp_path / "home", "--listen", "/ip4/127.0.0.1/tcp/0")
    assert code == 0
    assert list(by) == ["python", "shoal", "torch", "device", "models", "libp2p", "listen", "disk", "identity"]
    assert by["python"]["verdict"] == "ok" and by["python"]["data"]["version"] == platform.python_version()
    assert by["torch"]["data"]["version"] == torch.__version__
    assert by["torch"]["data"]["cuda_available"] == torch.cuda.is_available()
    import torch

    # `shoal node` with --device auto trains on the GPU when torch sees one
    assert by["device"]["data"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert 0 < by["device"]["data"]["free_bytes"] <= by["device"]["data"]["total_bytes"]
    assert "tiny" in by["models"]["data"]["fits"]
    assert by["libp2p"]["verdict"] == "ok" and by["libp2p"]["data"]["libp2p"] == "0.8.1"
    assert by["listen"]["verdict"] == "warn" and "only this machine" in by["listen"]["summary"]
    free = shutil.disk_usage(tmp_path).free
    assert abs(by["disk"]["data"]["free_bytes"] - free) < 0.05 * free
    assert by["identity"]["verdict"] == "ok" and by["identity"]["data"]["peer_id"] == peer_id

    key.chmod(0o644)  # a key others can read is a failure, with the exact fix
    code, by = doctor(tmp_path / "home", "--listen", "/ip4/127.0.0.1/tcp/0")
    assert code == 1 and by["identity"]["verdict"] == "fail" and by["identity"]["fix"] == f"chmod 600 {key}"


def test_a_broken_libp2p_is_a_failure_with_the_fix(tmp_path):
    fake = tmp_path / "site" / "fastecdsa"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libgmp.so.10: cannot open shared object file')\n")
    code, by = doctor(tmp_path / "home", "--join", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}",
                      env={"PYTHONPATH": str(tmp_path / "site")})
    assert code == 1 and by["libp2p"]["verdict"] == "fail" and "libgmp.so.10" in by["libp2p"]["summary"]
    assert by["libp2p"]["fix"] == libp2p_fix(platform.system(), sys.version_info[:2], True, True)
    assert by["join"]["verdict"] == "fail" and "libp2p" in by["join"]["summary"]


def test_the_libp2p_fix_names_the_build_deps_where_fastecdsa_compiles():
    assert "--force-reinstall" in libp2p_fix("Linux", (3, 11), False, False)
    linux = libp2p_fix("Linux", (3, 12), have_compiler=False, have_gmp=True)
    assert "apt-get install -y build-essential python3-dev libgmp-dev" in linux
    assert "dnf install -y gcc python3-devel gmp-devel" in linux and "lacks a C compiler" in linux
    mac = libp2p_fix("Darwin", (3, 11), have_compiler=True, have_gmp=False)
    assert "brew install gmp" in mac and "gmp.h" in mac and "brew --prefix gmp" in mac


@pytest.fixture
def silent_tcp():
    """A TCP port that accepts connections and never says a word (not a libp2p node)."""
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv.getsockname()[1]
    srv.close()


def test_join_addresses_that_do_not_answer(tmp_path, silent_tcp):
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed = s.getsockname()[1]  # closed again at once: nothing listens there
    t0 = time.monotonic()
    r = subprocess.run([*SHOAL, "doctor", "--json", "--timeout", "2",
                        "--join", f"/ip4/127.0.0.1/tcp/{closed}/p2p/{PEER}",
                        "--join", f"/ip4/127.0.0.1/tcp/{silent_tcp}/p2p/{PEER}",
                        "--join", "/ip4/127.0.0.1/tcp/4001"],  # no peer id
                       capture_output=True, text=True, timeout=120, env={**os.environ, "SHOAL_HOME": str(tmp_path)})
    assert r.returncode == 1 and not json.loads(r.stdout)["ok"]
    joins = [c for c in json.loads(r.stdout)["checks"] if c["name"] in ("join", "clock")]
    assert [c["name"] for c in joins] == ["join"] * 3 and all(c["verdict"] == "fail" and c["fix"] for c in joins)
    refused, silent, bad = joins
    assert "connection refused" in refused["summary"]
    assert "answers TCP" in silent["summary"] and "handshake" in silent["summary"]
    assert "/p2p/" in bad["summary"]
    assert time.monotonic() - t0 < 60  # every wait is bounded by --timeout


@pytest.mark.slow
def test_join_a_live_node_and_a_wrong_peer_id(tmp_path):
    status = tmp_path / "node.json"
    env = {**os.environ, "SHOAL_HOME": str(tmp_path / "nodehome")}
    proc = subprocess.Popen([*SHOAL, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity",
                             str(tmp_path / "node.key"), "--status-file", str(status),
                             "--address-file", str(tmp_path / "node.addrs")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        addrs = read_join_file(tmp_path / "node.addrs", wait_s=60)
        node_id = peer_id_of(load_or_create_identity(tmp_path / "node.key"))
        assert addrs == [f"{a}" for a in addrs if a.endswith(f"/p2p/{node_id}")]
        code, by = doctor(tmp_path / "home", "--join", f"@{tmp_path / 'node.addrs'}")
        join = by["join"]
        assert code == 0 and join["verdict"] == "ok" and join["data"]["peer_id_match"], join
        assert "/shoal/rpc/1.0.0" in join["data"]["protocols"] and join["data"]["swarm_peers"] == 1
        assert 0 < join["data"]["tcp_ms"] < 1000 and 0 < join["data"]["dial_ms"] < 5000
        clock = by["clock"]
        assert clock["verdict"] == "ok" and list(clock["data"]["peers"]) == [node_id]
        assert abs(clock["data"]["peers"][node_id]["offset_s"]) < 0.5  # one machine, one clock
        reach = by["reachability"]  # the node really dialed this machine back: on its network, not public
        assert reach["data"]["reachability"] == "lan" and reach["data"]["answers"] == 1, reach
        assert reach["verdict"] == "info" and "forward TCP port" in reach["fix"]

        wrong = addrs[0].replace(node_id, peer_id_of(load_or_create_identity(None)))
        code, by = doctor(tmp_path / "home", "--timeout", "5", "--join", wrong)
        assert code == 1 and by["join"]["verdict"] == "fail" and not by["join"]["data"]["peer_id_match"]
        assert "another peer id" in by["join"]["summary"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not (tmp_path / "node.addrs").exists()  # a clean leave takes its address file away


def test_health_verdicts():
    now = 1000.0
    ok = {"time": now - 1, "state": "training", "peers": ["a", "b"]}
    assert verdict(ok, now=now, min_peers=1, max_age_s=30) is None
    assert "old" in verdict({**ok, "time": now - 60}, now=now, min_peers=1, max_age_s=30)
    assert "starting" in verdict({**ok, "state": "starting"}, now=now, min_peers=1, max_age_s=30)
    assert "error" in verdict({**ok, "error": "boom"}, now=now, min_peers=1, max_age_s=30)
    assert "0 peer" in verdict({**ok, "peers": []}, now=now, min_peers=1, max_age_s=30)
    assert verdict({**ok, "peers": []}, now=now, min_peers=0, max_age_s=30) is None


def test_health_command_reads_the_status_file(tmp_path):
    f = tmp_path / "status.json"
    r = subprocess.run([*SHOAL, "health", "--status-file", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot read" in r.stderr
    f.write_text(json.dumps({"time": time.time(), "state": "ready", "peers": ["x"], "peer_id": PEER}))
    r = subprocess.run([*SHOAL, "health", "--status-file", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("healthy")


def test_join_files_round_trip_and_wait(tmp_path):
    path = tmp_path / "a" / "addrs"
    write_address_file(path, [f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"])
    assert read_join_file(path, wait_s=0) == [f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}"]  # loopback left out
    assert expand_join([f"@{path}", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}"], 0) == [
        f"/ip4/10.0.0.5/tcp/4001/p2p/{PEER}", f"/ip4/1.2.3.4/tcp/1/p2p/{PEER}"]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="no addresses there after 0.5 s"):
        read_join_file(tmp_path / "missing", wait_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5


def test_wildcard_addresses_become_dialable_ones():
    addrs = expand_wildcard([f"/ip4/0.0.0.0/tcp/4001/p2p/{PEER}"], local=["127.0.0.1", "10.1.2.3"])
    assert addrs == [f"/ip4/10.1.2.3/tcp/4001/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}"]
    assert expand_wildcard(["/ip4/127.0.0.1/tcp/1/p2p/X"], local=["10.1.2.3"]) == ["/ip4/127.0.0.1/tcp/1/p2p/X"]
    assert [scope(ip) for ip in ("127.0.0.1", "10.0.0.1", "100.64.1.1", "169.254.0.1", "8.8.8.8")] == \
        ["loopback", "private", "shared", "link-local", "public"]


def test_the_model_fit_counts_the_real_models_parameters():
    import dataclasses

    from shoal.node.train.model import GPTConfig, build_model
    from shoal.protocol.manifest import ModelSpec, RunManifest

    assert num_params("tiny") == build_model(GPTConfig.from_spec(ModelSpec.preset("tiny"), 128)).num_params()
    for positions in ("rope", "learned"):
        m = dataclasses.replace(RunManifest.default("tiny"), model=ModelSpec.preset("tiny", positions=positions))
        assert m.stage_params(0) == build_model(GPTConfig.from_spec(m.model, m.batch.seq_len)).num_params()
    assert fit("tiny", 0).max_micro_batch == 0 and not fit("base", 2 * 10**9).fits
    big = fit("base", 80 * 10**9)
    assert big.fits and 1 <= big.max_micro_batch <= 16


def test_run_create_if_missing_keeps_the_first_manifest(tmp_path):
    """The compose `init` service runs this on every `up`: the run (and so its id) must survive restarts."""
    args = [*SHOAL, "run", "create", "--if-missing", "-o", str(tmp_path / "run.toml"), "--identity",
            str(tmp_path / "id.key"), "--replicas", "2"]
    env = {**os.environ, "SHOAL_HOME": str(tmp_path)}
    first = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    text = (tmp_path / "run.toml").read_text()
    again = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert first.returncode == 0 and again.returncode == 0, again.stderr
    assert "wrote" in first.stdout and "kept" in again.stdout and (tmp_path / "run.toml").read_text() == text
    run_id = [ln.split()[-1] for ln in first.stdout.splitlines() if ln.startswith("run id")]
    assert run_id and run_id == [ln.split()[-1] for ln in again.stdout.splitlines() if ln.startswith("run id")]
    (tmp_path / "run.toml").write_text(text.replace("replicas = 2", "replicas = 3"))  # no longer what was signed
    bad = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "not a valid manifest" in bad.stderr


def test_a_private_listen_address_needs_nothing_configured_as_the_readme_says(monkeypatch):
    """Behind a home router a node needs nothing configured (relays, hole punching): doctor says so and offers port
    forwarding only as an option, as the README's NAT section does."""
    from shoal.node.doctor import checks
    from shoal.swarm.net import addresses

    monkeypatch.setattr(addresses, "local_ipv4", lambda: ["127.0.0.1", "192.168.1.20"])
    c = checks.check_listen("/ip4/0.0.0.0/tcp/0")
    assert c.verdict == "info" and "nothing to configure" in c.summary and c.fix.startswith("optional: ")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "### Behind a home router (NAT)\n\nNothing to configure." in readme
