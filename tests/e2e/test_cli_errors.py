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
    (d / "corpus").mkdir()  # the run reads a local folder: a node that joins by id needs its own --data
    (d / "corpus" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    made = shoal(d / "owner-home", "run", "create", "--replicas", "2", "--steps", "1", "--join-secret-file",
                 str(d / "secret.txt"), "--identity", str(d / "owner.key"), "-o", str(d / "private.toml"),
                 "--data", str(d / "corpus"))
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
              *(("--secret", secret, "--data", str(swarm["dir"] / "corpus")) if secret else ()))
    assert_one_line(r, Exit.SECRET, "this run is private", "wrong join secret" if secret else "required", "--secret")


def test_a_run_that_reads_a_local_folder_joined_without_data(swarm):
    """The manifest from the network names a path: the node refuses to read it on the owner's word. The refusal is
    raised deep in the node's task tree (inside two nurseries), and still reaches the terminal as its own line,
    hint and exit status; the run's owner sees why the peer left, not an exception group's name."""
    owner_out = swarm["dir"] / "owner.out"
    before = len(owner_out.read_text())
    r = shoal(swarm["home"], "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--join", swarm["owner"], "--run",
              swarm["run_id"], "--secret", SECRET)
    line = assert_one_line(r, Exit.USAGE, "reads its data from a local path", "hint: give this node its copy of the "
                           "run's data with --data PATH")
    assert "ExceptionGroup" not in line and "unexpected" not in line
    left = wait_for(lambda: re.search(r"peer \w+ left \((.*)\)", owner_out.read_text()[before:]), 30,
                    "the owner's line about the peer that left")
    assert left.group(1).startswith("UntrustedData: run "), left.group(0)


def test_typed_input_is_checked_before_anything_runs(tmp_path):
    """A malformed --join, a --data that is not there and a device this machine lacks are refused before the node
    makes an identity or probes the hardware: one line, a hint, exit 2 (9 for the device)."""
    home = tmp_path / "home"

    def run(*args: str, **env: str):  # the machine's hardware cache in the home: a probe would show there
        return shoal(home, *args, SHOAL_CACHE=str(home / "cache"), **env)

    for join, needle in [("/ip4/127.0.0.1/tcp/4001", "lacks the node's peer id (…/p2p/12D3KooW…)"),
                         ("127.0.0.1:4001", "not an address of the form /ip4/IP/tcp/PORT/p2p/PEER_ID"),
                         ("/ip4/127.0.0.1/tcp/4001/p2p", "not an address of the form")]:
        line = assert_one_line(run("node", "--join", join), Exit.USAGE, f"--join {join}: ", needle,
                               "hint: copy the whole address a node prints")
        assert "Protocol(" not in line
        assert_one_line(run("peers", "--join", join), Exit.USAGE, needle)
    assert_one_line(run("node", "--data", str(tmp_path / "nope"), "--run", "f" * 64),
                    Exit.USAGE, "--data", "no such file or folder")
    assert_one_line(run("node", "--device", "cuda", CUDA_VISIBLE_DEVICES=""), Exit.NO_DEVICE,
                    "--device cuda: CUDA is not available")
    made = list(home.rglob("*.key")) + list(home.rglob("hardware-*.json"))
    assert not made, made  # no identity made, no hardware probed


def test_run_create_checks_data_where_it_is_typed(tmp_path):
    r = shoal(tmp_path, "run", "create", "--data", str(tmp_path / "nope"), "-o", str(tmp_path / "a.toml"))
    assert_one_line(r, Exit.USAGE, "shoal run create: --data", "no such file or folder", "hint: --data takes")
    assert not (tmp_path / "a.toml").exists()  # nothing signed
    (tmp_path / "empty").mkdir()
    r = shoal(tmp_path, "run", "create", "--data", str(tmp_path / "empty"), "-o", str(tmp_path / "a.toml"))
    assert_one_line(r, Exit.USAGE, "holds no .txt, .jsonl or .parquet file")
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "doc.txt").write_text("text")
    r = subprocess.run([*SHOAL, "run", "create", "--data", "./mydata", "-o", "b.toml"], capture_output=True,
                       text=True, timeout=120, env=env_for(tmp_path / "home"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f'source = "{tmp_path / "mydata"}"' in (tmp_path / "b.toml").read_text()  # absolute, as every node reads it


@pytest.mark.parametrize("argv, prog, unknown", [(["node", "--jion", "x"], "shoal node", "--jion x"),
                                               (["swarm", "up", "--step", "3"], "shoal swarm up", "--step 3"),
                                               (["run", "create", "--replica", "3", "-o", "x.toml"],
                                                "shoal run create", "--replica 3")])
def test_a_flag_typo_shows_the_sub_commands_usage_and_abbreviations_are_refused(tmp_path, argv, prog, unknown):
    r = shoal(tmp_path, *argv)
    assert r.returncode == 2 and r.stderr.startswith(f"usage: {prog} "), r.stderr
    assert f"{prog}: error: unrecognized arguments: {unknown}" in r.stderr, r.stderr


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


def as_at_a_terminal() -> None:
    """In the child before exec: SIGINT's default disposition, as a command typed at a terminal has it. A test
    runner started as a shell's background job ignores SIGINT, its children inherit that, and Python then installs
    no KeyboardInterrupt handler: shoal rightly stays deaf to Ctrl+C there, which is not what this test asks."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
                                    stdout=f, stderr=subprocess.PIPE, text=True, env=env_for(tmp_path),
                                    preexec_fn=as_at_a_terminal)
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


def test_the_readmes_two_nodes_on_one_machine_train_and_a_run_signed_by_another_key_is_explained(tmp_path):
    """The README's example: the first node runs with the key that signed the run and starts it; the second joins
    it by id with its own key. A first node with another key is refused (exit 4) with a hint that says which key."""
    home = tmp_path / "home"
    a, b, run = tmp_path / "a.key", tmp_path / "b.key", tmp_path / "run.toml"
    made = shoal(home, "run", "create", "--replicas", "2", "--identity", str(a), "-o", str(run))
    assert made.returncode == 0, made.stderr
    run_id = made.stdout.split("run id")[1].split()[0]
    r = shoal(home, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(b), "--run", str(run))
    assert_one_line(r, Exit.UNKNOWN_RUN, "only its owner", "hint: start the run's first node with the identity "
                    "that signed it")
    procs, outs = [], []
    try:
        outs.append(open(tmp_path / "a.out", "w"))
        procs.append(subprocess.Popen([*SHOAL, "node", "--listen", "/ip4/127.0.0.1/tcp/0", "--identity", str(a),
                                       "--run", str(run), "--address-file", str(tmp_path / "a.addrs"), "--threads",
                                       "1", "--steps", "3"], stdout=outs[-1], stderr=subprocess.STDOUT,
                                      env=env_for(home)))
        wait_for(lambda: (tmp_path / "a.addrs").exists() or procs[0].poll() is not None, 90, "the first node")
        addr = (tmp_path / "a.addrs").read_text().split()[0]
        outs.append(open(tmp_path / "b.out", "w"))
        procs.append(subprocess.Popen([*SHOAL, "node", "--join", addr, "--identity", str(b), "--run", run_id,
                                       "--threads", "1", "--steps", "3", "--print-every", "1"], stdout=outs[-1],
                                      stderr=subprocess.STDOUT, env=env_for(home)))
        wait_for(lambda: all(re.search(r"step 3/3", (tmp_path / f"{n}.out").read_text()) for n in "ab")
                 or any(p.poll() is not None for p in procs), 180, "both nodes to train 3 steps")
        assert all(p.poll() is None for p in procs), [(tmp_path / f"{n}.out").read_text() for n in "ab"]
    finally:
        for p in procs:
            stop(p)
        for f in outs:
            f.close()
