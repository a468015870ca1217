"""Every expected error of `shoal node` and `shoal train`, as a user meets it: one line on stderr with a hint, its own
exit status, no traceback (-v shows it). Real processes on 127.0.0.1: a run owner's node hosting a private run and a
second node joined to it stand for the swarm."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.node.cli.errors import Exit

pytestmark = pytest.mark.slow
SHOAL = [sys.executable, "-m", "shoal.node.cli"]
SECRET = "s3cret-for-tests"
NO_SUCH_PEER = "12D3KooWJNHMjwbG7TLWUw8icoPwNnqjcgwPBBq5or4nMrUmHYkF"
STATUS_LINE = re.compile(r"^\d\d:\d\d:\d\d · \w+ · \d+ peers?\b", re.M)


def env_for(home: Path, **extra: str) -> dict:
    return {**os.environ, "SHOAL_HOME": str(home), "PYTHONUNBUFFERED": "1", **extra}


def shoal(home: Path, *args: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SHOAL, *args], capture_output=True, text=True, timeout=timeout_s, env=env_for(home, **env))


def assert_one_line(r: subprocess.CompletedProcess, code: Exit, *needles: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code, f"exit {r.returncode}, not {int(code)}:\n{r.stdout}\n{r.stderr}"
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "; hint: " in lines[0] or code is Exit.INTERRUPTED, lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s: {what}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A run owner's node hosting a private run (it waits for its group: no training) and a plain node joined to it.
    Both print to files; the second one's first status line is timed from its start."""
    d = tmp_path_factory.mktemp("errors")
    (d / "secret.txt").write_text(SECRET)
    made = shoal(d / "owner-home", "run", "create", "--replicas", "2", "--steps", "1", "--join-secret-file",
                 str(d / "secret.txt"), "--identity", str(d / "owner.key"), "-o", str(d / "private.toml"))
    assert made.returncode == 0, made.stderr
    run_id = made.stdout.split("run id")[1].split()[0]
    procs = []
    owner_out = open(d / "owner.out", "w")
    procs.append(subprocess.Popen(
        [*SHOAL, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(d / "owner.key"), "--run",
         str(d / "private.toml"), "--secret", SECRET, "--steps", "0", "--threads", "1", "--address-file",
         str(d / "owner.addrs")],
        stdout=owner_out, stderr=subprocess.STDOUT, env=env_for(d / "owner-home")))
    wait_for(lambda: (d / "owner.addrs").exists() or procs[0].poll() is not None, 90, "the owner's node")
    assert procs[0].poll() is None, (d / "owner.out").read_text()
    member_out = open(d / "member.out", "w")
    t0 = time.monotonic()
    procs.append(subprocess.Popen(
        [*SHOAL, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(d / "member.key"), "--join",
         f"@{d / 'owner.addrs'}", "--address-file", str(d / "member.addrs"), "--print-every", "1"],
        stdout=member_out, stderr=subprocess.STDOUT, env=env_for(d / "member-home")))
    first_status_s = wait_for(lambda: STATUS_LINE.search((d / "member.out").read_text()) and time.monotonic() - t0,
                              90, "the member's first status line")
    try:
        yield {"dir": d, "run_id": run_id, "owner": (d / "owner.addrs").read_text().split()[0],
               "member": (d / "member.addrs").read_text().split()[0], "first_status_s": first_status_s,
               "home": d / "clients"}
    finally:
        for p in procs:
            stop(p)
        owner_out.close()
        member_out.close()


def test_the_status_line_appears_within_the_first_seconds(swarm):
    out = (swarm["dir"] / "member.out").read_text()
    assert "log: " in out.splitlines()[0] and "ready; others join with: shoal node --join /ip4/127.0.0.1/" in out
    assert swarm["first_status_s"] < 20, swarm["first_status_s"]  # ~3 s on an idle 2-core machine
    print(f"first status line {swarm['first_status_s']:.1f} s after the start")


def test_unreachable_join_address(tmp_path):
    r = shoal(tmp_path, "node", "--join", f"/ip4/127.0.0.1/tcp/1/p2p/{NO_SUCH_PEER}")
    assert_one_line(r, Exit.JOIN_UNREACHABLE, "could not reach the --join address", "connection refused")


def test_unknown_run_id(swarm):
    r = shoal(swarm["home"], "node", "--join", swarm["owner"], "--run", "f" * 64)
    assert_one_line(r, Exit.UNKNOWN_RUN, "no joined peer gave the manifest of run ffff")


@pytest.mark.parametrize("secret", [None, "wrong"])
def test_missing_or_wrong_secret(swarm, secret):
    r = shoal(swarm["home"], "node", "--join", swarm["owner"], "--run", swarm["run_id"],
              *(("--secret", secret) if secret else ()))
    assert_one_line(r, Exit.SECRET, "this run is private", "wrong join secret" if secret else "required", "--secret")


def test_the_run_owner_without_the_secret(swarm, tmp_path):
    r = shoal(tmp_path, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--run", str(swarm["dir"] / "private.toml"))
    assert_one_line(r, Exit.SECRET, "this run is private")


def test_corrupt_or_unreadable_identity_and_the_traceback_with_v(tmp_path):
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    assert_one_line(shoal(tmp_path, "node", "--identity", str(bad)), Exit.IDENTITY_UNUSABLE, "32-byte Ed25519 seed")
    folder = tmp_path / "a-folder.key"
    folder.mkdir()
    assert_one_line(shoal(tmp_path, "node", "--identity", str(folder)), Exit.IDENTITY_UNUSABLE, "cannot read it")
    verbose = shoal(tmp_path, "node", "-v", "--identity", str(bad))
    assert verbose.returncode == Exit.IDENTITY_UNUSABLE and "Traceback" in verbose.stderr


def test_an_identity_in_use_on_this_machine(swarm):
    r = shoal(swarm["home"], "node", "--identity", str(swarm["dir"] / "owner.key"))
    assert_one_line(r, Exit.IDENTITY_IN_USE, "is in use by another shoal node on this machine (pid")


def test_an_identity_in_use_elsewhere_in_the_swarm(swarm, tmp_path):
    """A copy of the owner's key, joining through the other node: refused by what the swarm says, and the owner
    and the member are not disturbed."""
    twin = tmp_path / "copied.key"
    shutil.copy(swarm["dir"] / "owner.key", twin)
    r = shoal(tmp_path, "node", "--identity", str(twin), "--listen", "/ip4/127.0.0.1/tcp/0", "--join", swarm["member"])
    assert_one_line(r, Exit.IDENTITY_IN_USE, "another node in the swarm runs with this identity")
    r = shoal(tmp_path, "node", "--identity", str(twin), "--listen", "/ip4/127.0.0.1/tcp/0", "--join", swarm["owner"])
    assert_one_line(r, Exit.IDENTITY_IN_USE, "own peer id")
    peers = shoal(tmp_path, "peers", "--join", swarm["member"], "--json")
    assert peers.returncode == 0 and peers.stderr == "", peers.stderr
    seen = {r["peer_id"]: r["last_seen_s"] for r in json.loads(peers.stdout)}
    for who in ("owner", "member"):
        assert seen[swarm[who].rsplit("/", 1)[1]] < 6, seen  # both still live and heard from


def test_a_listen_port_in_use(swarm):
    port = swarm["owner"].split("/tcp/")[1].split("/")[0]
    r = shoal(swarm["home"], "node", "--listen", f"/ip4/127.0.0.1/tcp/{port}")
    assert_one_line(r, Exit.ADDRESS_IN_USE, "address already in use")


def test_a_model_too_big_is_refused(tmp_path):
    made = shoal(tmp_path, "run", "create", "--layers", "64", "--d-model", "16384", "--heads", "128",
                 "-o", str(tmp_path / "huge.toml"))
    assert made.returncode == 0, made.stderr
    r = shoal(tmp_path, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--run", str(tmp_path / "huge.toml"))
    assert_one_line(r, Exit.DOES_NOT_FIT, "needs ~", "GB free")


def test_train_on_cuda_without_cuda(tmp_path):
    r = shoal(tmp_path, "train", "--device", "cuda", "--steps", "1", "--out", str(tmp_path / "out"),
              CUDA_VISIBLE_DEVICES="")
    assert_one_line(r, Exit.NO_DEVICE, "--device cuda: CUDA is not available")


@pytest.mark.parametrize("sig, when", [(signal.SIGINT, "imports"), (signal.SIGINT, "joining"),
                                       (signal.SIGTERM, "joining")])
def test_interrupted_during_start_up(tmp_path, sig, when):
    """A join address that accepts connections and never answers keeps the node in start-up; a signal then (or
    while Python is still importing) ends it at once with one line and exit 130."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen()
        port = hole.getsockname()[1]
        out = tmp_path / "out.txt"
        with open(out, "w") as f:
            proc = subprocess.Popen([*SHOAL, "node", "--join", f"/ip4/127.0.0.1/tcp/{port}/p2p/{NO_SUCH_PEER}"],
                                    stdout=f, stderr=subprocess.PIPE, text=True, env=env_for(tmp_path))
        try:
            if when == "imports":
                time.sleep(0.3)
            else:
                wait_for(lambda: "joining the swarm" in out.read_text(), 60, "the join under way")
            t0 = time.monotonic()
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=30)
        finally:
            stop(proc)
            proc.stderr.close()
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err)
    assert_one_line(r, Exit.INTERRUPTED, "interrupted")
    assert time.monotonic() - t0 < 10
