"""compose/ end to end: the image built offline, `docker compose up` with 3 nodes training, `shoal doctor` inside a
node, a killed worker replaced by the backup, `down -v`, and nothing left behind. Runs a private Docker engine
(tests/helpers/docker_engine.py); a missing tool or an engine that does not start fails the test, it never skips."""

from __future__ import annotations

import faulthandler
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import compose_prebuild
from tests.helpers.docker_engine import DockerEngine, cached_data_root, ensure_tools

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
PROJECT = "shoal"
LABEL = f"label=com.docker.compose.project={PROJECT}"
#: the offline build's cache (base tarball, Debian packages, wheelhouse) and the engine's kept image store
CACHE = compose_prebuild.CACHE
TIMEOUT_S = 1800


def compose(engine: DockerEngine, *args: str, timeout_s: float = 300.0, env: dict | None = None) -> str:
    """compose/shoal-compose, as the README runs it (with Debian's docker-compose v1.29 here)."""
    r = subprocess.run([str(ROOT / "compose" / "shoal-compose"), "-p", PROJECT, *args],
                       env={**engine.env, **(env or {})}, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise AssertionError(f"docker-compose {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n"
                             f"{r.stderr[-3000:]}")
    return r.stdout


def statuses(engine: DockerEngine) -> dict[str, dict]:
    """Container name -> its node's status.json, for every running shoal node container."""
    names = engine.docker("ps", "--filter", LABEL, "--format", "{{.Names}}").stdout.split()
    out = {}
    for name in names:
        r = engine.docker("exec", name, "cat", "/data/status.json", check=False, timeout_s=30)
        if r.returncode == 0:
            try:
                out[name] = json.loads(r.stdout)
            except ValueError:  # caught mid-write is impossible (atomic rename); a truncated pipe is not
                continue
    return out


def health(engine: DockerEngine, name: str) -> str:
    return engine.docker("inspect", name, "--format", "{{.State.Health.Status}}").stdout.strip()


class Watch:
    """Polls the nodes' status and keeps, per container, every (step -> state hash) it saw."""

    def __init__(self, engine: DockerEngine):
        self.engine = engine
        self.hashes: dict[str, dict[int, str]] = {}
        self.last: dict[str, dict] = {}

    def poll(self) -> dict[str, dict]:
        self.last = statuses(self.engine)
        for name, st in self.last.items():
            if st.get("slot") and st.get("state_hash") and st.get("step"):
                self.hashes.setdefault(name, {})[st["step"]] = st["state_hash"]
            if st.get("slot"):  # the status file also lists the hashes of the node's last steps
                for step, h in (st.get("recent_hashes") or {}).items():
                    self.hashes.setdefault(name, {})[int(step)] = h
        return self.last

    def active(self) -> dict[str, dict]:
        return {n: st for n, st in self.last.items() if st.get("slot") and st.get("state") in ("training", "syncing")}

    def until(self, pred, timeout_s: float, what: str) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            self.poll()
            if pred():
                return time.monotonic() - t0
            time.sleep(0.5)
        rows = {n: {k: st.get(k) for k in ("role", "slot", "step", "state", "state_hash", "peers", "error")}
                for n, st in self.last.items()}
        logs = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "-p", PROJECT, "logs", "--tail", "30"],
                              env=self.engine.env, capture_output=True, text=True, timeout=60).stdout
        raise AssertionError(f"timed out after {timeout_s} s: {what}\n{json.dumps(rows, indent=1)}\n{logs[-6000:]}")

    def common_steps(self, a: str, b: str) -> list[int]:
        return sorted(set(self.hashes.get(a, {})) & set(self.hashes.get(b, {})))

    def assert_same_state(self, a: str, b: str) -> int:
        """Both replicas were seen at some same step, and at every such step their state hashes agree."""
        common = self.common_steps(a, b)
        assert common, (a, b, self.hashes)
        bad = [step for step in common if self.hashes[a][step] != self.hashes[b][step]]
        if bad:
            rows = {n: {s: h[:12] for s, h in sorted(self.hashes[n].items()) if s >= bad[0] - 3} for n in (a, b)}
            raise AssertionError(f"{a} and {b} differ at steps {bad} (of {len(common)} seen at both):\n"
                                 f"{json.dumps(rows, indent=1)}\n" + "\n".join(self.story(n) for n in (a, b)))
        return len(common)

    def story(self, name: str) -> str:
        """What a node's log says about its group, rounds and state (the lines a hash difference is explained by)."""
        # the terminal (docker logs) shows a node's errors only; its log file, under SHOAL_HOME=/data, has the rest
        r = self.engine.docker("exec", name, "sh", "-c", "cat /data/logs/node-*.log", check=False, timeout_s=60)
        keep = re.compile(r"WARNING|ERROR|hash vote|re-fetch|refetch|entered|entering|promoted|skipped|clipped|left out")
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if keep.search(ln) and "libp2p" not in ln]
        return f"--- {name}: {len(lines)} lines of note, the last 60:\n" + "\n".join(lines[-60:])


def test_compose_config_validates():
    ensure_tools()
    for profiles in ([], ["--profile", "gpu", "--profile", "dash"]):
        r = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), *profiles, "config", "-q"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    r = subprocess.run(["docker-compose", "-f", str(COMPOSE_FILE), "config", "--services"], capture_output=True,
                       text=True, timeout=60)
    assert {"init", "bootstrap", "node", "dash"} <= set(r.stdout.split())


@pytest.mark.compose_image
@pytest.mark.timeout(TIMEOUT_S)
def test_compose_swarm_trains_replaces_a_killed_worker_and_leaves_nothing():
    # a cold build alone can pass the suite-wide 300 s traceback dump: this test's bound is its own timeout
    faulthandler.dump_traceback_later(TIMEOUT_S - 60, exit=False)
    # the background build (tests/conftest.py) first: it holds the engine's cache; the build below then finds every
    # phase done, or redoes what failed there and says why
    timings: dict[str, float] = compose_prebuild.wait(TIMEOUT_S / 2)
    ensure_tools()
    t0 = time.monotonic()
    with cached_data_root(CACHE) as data_root, DockerEngine(data_root=data_root) as engine:
        timings["engine_start_s"] = time.monotonic() - t0
        t_build = time.monotonic()
        r = subprocess.run([str(ROOT / "compose" / "build-offline.sh")], env={**engine.env, "SHOAL_BUILD_CACHE": str(CACHE)},
                           capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, f"offline build failed:\n{r.stderr[-4000:]}"
        timings["build_s"] = time.monotonic() - t_build
        for phase, secs in re.findall(r"build-offline: (\w+).* done in (\d+) s", r.stderr):
            timings[f"build_{phase}_s"] = float(secs)
        image_bytes = int(engine.docker("image", "inspect", "shoal:latest", "--format", "{{.Size}}").stdout)
        user = engine.docker("image", "inspect", "shoal:latest", "--format", "{{.Config.User}}").stdout.strip()
        assert user == "shoal"  # not root
        watch = Watch(engine)
        # a run of this test killed before its `down -v` (the engine's data root is a kept cache) leaves containers
        # and volumes of an older build: the swarm starts from nothing
        compose(engine, "down", "-v", "--remove-orphans", timeout_s=120)
        try:
            t_up = time.monotonic()
            # 3 nodes in all; steps paced (0.3 s) so the watch sees both replicas at one step from their status files
            compose(engine, "up", "-d", "--scale", "node=2", env={"SHOAL_STEPS": "5000", "SHOAL_MIN_STEP_TIME": "0.3"})
            # the run trains: two replicas (the bootstrap holds one), a backup; steps advance, states agree
            watch.until(lambda: len(watch.active()) == 2 and all(st.get("state_hash") for st in watch.active().values()),
                        240, "two replicas training with state hashes")
            timings["up_to_first_synchronized_step_s"] = time.monotonic() - t_up
            first = {n: st["step"] for n, st in watch.active().items()}
            watch.until(lambda: all(watch.active().get(n, {}).get("step", 0) >= s + 5 for n, s in first.items()),
                        120, "steps to advance")
            boot = next(n for n in watch.last if "bootstrap" in n)
            victim = next(n for n in watch.active() if n != boot)
            watch.until(lambda: len(watch.common_steps(boot, victim)) >= 2, 120, "both replicas seen at one step")
            watch.assert_same_state(boot, victim)
            backup = next(n for n, st in watch.last.items() if st.get("role") == "backup")
            # every node turns healthy by its HEALTHCHECK (up and seeing peers)
            names = list(watch.last)
            watch.until(lambda: all(health(engine, n) == "healthy" for n in names), 90, "every node healthy")

            # shoal doctor inside a node container, against the bootstrap
            r = engine.docker("exec", backup, "shoal", "doctor", "--join", "@/shared/bootstrap.addrs", "--json",
                              check=False, timeout_s=120)
            doc = json.loads(r.stdout)
            by = {c["name"]: c for c in doc["checks"]}
            assert r.returncode == 0 and doc["ok"], doc
            assert by["python"]["data"]["version"].startswith("3.11.")
            assert by["libp2p"]["verdict"] == "ok" and by["torch"]["data"]["cuda_build"] is None
            assert by["device"]["data"]["device"] == "cpu" and "tiny" in by["models"]["data"]["fits"]
            assert by["identity"]["verdict"] == "ok" and by["identity"]["data"]["mode"] == "0o600"
            assert by["join"]["verdict"] == "ok" and by["join"]["data"]["peer_id_match"]
            assert by["join"]["data"]["swarm_peers"] == 3 and "/shoal/rpc/1.0.0" in by["join"]["data"]["protocols"]
            assert by["clock"]["verdict"] == "ok" and len(by["clock"]["data"]["peers"]) == 3

            # the dash service's container reaches the swarm the same way (its observer, without the terminal UI)
            peers = json.loads(compose(engine, "run", "--rm", "-T", "dash", "peers", "--join", "@/shared/bootstrap.addrs",
                                       "--json", timeout_s=120))
            assert {p["peer_id"] for p in peers} == {st["peer_id"] for st in watch.last.values()}

            # kill the active worker: the broker promotes the backup, training goes on, states agree again
            engine.docker("kill", victim)
            t_kill = time.monotonic()
            watch.until(lambda: backup in watch.active(), 120, "the backup to be promoted")
            timings["kill_to_promotion_s"] = time.monotonic() - t_kill
            step_at = watch.active()[boot]["step"]
            watch.until(lambda: all(st.get("step", 0) >= step_at + 5 for st in watch.active().values())
                        and len(watch.active()) == 2, 180, "training to go on with the promoted backup")
            watch.until(lambda: len(watch.common_steps(boot, backup)) >= 2, 120, "both replicas seen at one step")
            watch.assert_same_state(boot, backup)
        finally:
            t_down = time.monotonic()
            compose(engine, "down", "-v", "--timeout", "20")
            timings["down_s"] = time.monotonic() - t_down
        assert engine.docker("ps", "-aq").stdout.split() == []
        assert engine.docker("volume", "ls", "-q").stdout.split() == []
        assert set(engine.docker("network", "ls", "--format", "{{.Name}}").stdout.split()) == {"host", "none"}
    # the daemon has exited; no process, mount, namespace or temporary folder of it remains
    assert engine.leftovers() == {"daemon_running": False, "pids": [], "mounts": [], "netns": False, "root": False}
    timings["total_s"] = time.monotonic() - t0
    print(f"compose e2e: image {image_bytes / 1e6:.0f} MB; " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
