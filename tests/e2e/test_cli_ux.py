"""The volunteer's command line, piece by piece (no swarm): device resolution, the memory estimate, errors and their
exit statuses, log routing around py-libp2p, the identity lock, a taken listen port, tables that fit 80 columns and
help text for every option."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from shoal.node.cli.errors import EXPECTED, CliError, Exit, classify
from shoal.node.identity_lock import IdentityInUse, default_identity, lock_identity
from shoal.node.run.config import RunConfig
from shoal.node.run.preflight import DoesNotFit, UntrustedData, preflight
from shoal.node.train import device as devmod
from shoal.node.train.device import DeviceUnavailable, resolve_device
from shoal.node.train.memory import stage_memory
from shoal.node.train.model import GPTConfig, build_stage
from shoal.protocol import manifest as mf
from shoal.swarm.net.listen import AddressInUse, check_free, check_sole_listener

SHOAL = [sys.executable, "-m", "shoal.node.cli"]


# -- the device a node trains on ---------------------------------------------------------------------------------
@pytest.fixture
def machine(monkeypatch):
    """Set what torch says about this machine: (CUDA devices, MPS available)."""

    def set_(cuda: int, mps: bool = False) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(devmod, "_mps_available", lambda: mps)

    return set_


def test_auto_trains_on_cuda_then_mps_then_the_cpu(machine):
    machine(cuda=2, mps=True)
    assert resolve_device("auto") == torch.device("cuda")
    machine(cuda=0, mps=True)
    assert resolve_device("auto") == torch.device("mps")
    machine(cuda=0, mps=False)
    assert resolve_device("auto") == torch.device("cpu")


def test_a_named_device_must_exist(machine):
    machine(cuda=2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailable, match="2 CUDA device"):
        resolve_device("cuda:2")
    machine(cuda=0)
    with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(DeviceUnavailable, match="MPS"):
        resolve_device("mps")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("tpu-ish")


def test_the_memory_estimate_counts_the_real_parameters_and_refuses_what_does_not_fit():
    for size in mf.MODEL_SIZES:
        m = mf.RunManifest.default(size)
        real = build_stage(GPTConfig.from_spec(m.model, m.batch.seq_len), 0, 1).num_params() if size != "base" \
            else None  # base is 200M parameters: too slow to build here (bench/results/gpu_node_check.md has it)
        need = stage_memory(m)
        if real is not None:
            assert need.params == real
        assert need.total_bytes > need.params * 16  # weights, gradients and AdamW's moments at least
    tiny = mf.RunManifest.default("tiny")
    need = stage_memory(tiny)
    cfg = RunConfig(manifest=tiny, device="cpu", device_free_bytes=int(need.total_bytes * 0.5))
    with pytest.raises(DoesNotFit, match="needs ~.* GB on cpu, which has .* GB free"):
        preflight(tiny, cfg)
    assert preflight(tiny, RunConfig(manifest=tiny, device="cpu", device_free_bytes=need.total_bytes * 2)) == need


@pytest.mark.gpu
def test_the_memory_estimate_matches_what_training_allocates_on_cuda():
    """A lone trainer (no synchronizer buffers: they are the estimate's margin) for three steps under autocast."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from shoal.node.train.trainer import Trainer

    for size in ("tiny", "small"):
        m = mf.RunManifest.default(size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t = Trainer(m, device="cuda")
        for _ in range(3):
            t.step()
        peak = torch.cuda.max_memory_allocated()
        assert 0.85 < stage_memory(m, half=True).total_bytes / peak < 1.3, (size, peak)
        del t


def test_pipelines_with_and_without_aqsgd_pass_the_plan_check():
    model = mf.ModelSpec.preset("tiny", tie_embeddings=False)
    for compression in ("aqsgd", "none"):
        m = mf.RunManifest.default("tiny", model=model, plan=mf.ParallelPlan(
            stages=2, replicas=1, pipeline=mf.PipelineSpec(compression=compression)))
        need = preflight(m, RunConfig(manifest=m))
        assert need.params == min(m.stage_params(0), m.stage_params(1))


# -- errors ------------------------------------------------------------------------------------------------------
def test_expected_errors_are_found_inside_exception_groups():
    import trio

    from shoal.swarm.run.broker import AdmissionError

    secret = AdmissionError("this run is private: wrong join secret")
    group = BaseExceptionGroup("nursery", [ExceptionGroup("inner", [secret]), trio.Cancelled._create()])
    assert classify(group).code is Exit.SECRET
    assert classify(AdmissionError("not on the allowlist")).code is Exit.NOT_ADMITTED
    # an error the expected one caused in a task beside it (a stream closed under it) does not hide it; the whole
    # tree goes to the log file, and -v prints it
    assert classify(ExceptionGroup("x", [trio.ClosedResourceError("closed"), secret])).code is Exit.SECRET
    assert classify(ExceptionGroup("x", [KeyError("bug")])) is None
    assert classify(KeyboardInterrupt()).code is Exit.INTERRUPTED
    assert classify(BaseExceptionGroup("x", [KeyError("torn down"), KeyboardInterrupt()])).code is Exit.INTERRUPTED
    untrusted = classify(ExceptionGroup("outer", [ExceptionGroup("inner", [UntrustedData("a local path")])]))
    assert untrusted.code is Exit.USAGE and "--data PATH" in untrusted.hint
    line = CliError("two\nlines", Exit.ADDRESS_IN_USE).line("shoal node")
    assert "\n" not in line and line.startswith("shoal node: two lines; hint: ")


def test_the_error_that_matters_names_a_failure_and_its_leave_reason():
    import trio

    from shoal.node.failure import cause, describe

    bug = ValueError("bad\x1b[2Jvalue\nhere")
    tree = BaseExceptionGroup("nursery", [trio.Cancelled._create(), ExceptionGroup("inner", [bug])])
    assert cause(tree) is bug
    assert describe(tree) == "ValueError: bad [2Jvalue here"  # one line, no escape a terminal acts on
    assert describe(BaseExceptionGroup("x", [trio.Cancelled._create()])) == "interrupted"
    assert describe(KeyboardInterrupt()) == "interrupted"
    assert len(describe(RuntimeError("x" * 500))) == 200


def test_every_expected_error_class_exists_and_every_status_is_distinct():
    import importlib

    for name in EXPECTED:
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name
    assert len({int(c) for c in Exit}) == len(Exit)


# -- logs --------------------------------------------------------------------------------------------------------
def test_repeated_records_are_kept_to_a_quota_with_a_count(tmp_path):
    """py-libp2p's repeated warnings (a failed store per peer, a rate limit per message) are written five times,
    then once an hour with how many were left out; other kinds are unaffected; -vv keeps everything."""
    import logging

    from shoal.node.cli.logquota import Quota, kind_of
    from shoal.node.cli.logs import LogFile

    now = [0.0]
    handler = LogFile(0, quota=Quota(burst=5, period_s=3600, clock=lambda: now[0]))
    handler.open(tmp_path / "node.log")
    lib = logging.getLogger("libp2p.kad_dht.value_store")
    lib.addHandler(handler)
    lib.propagate = False
    try:
        for i in range(100):
            now[0] = i
            lib.warning("Failed to store value at peer 12D3KooW%s: dial /ip4/127.0.0.1/tcp/%d failed",
                        "AbCdEfGhJkLmNpQrStUvWxYz" + "abcdefgh"[i % 8], 40000 + i)
        lib.warning("IHAVE rate limit exceeded for peer 12D3KooWAbCdEfGhJkLmNpQrStUvWxYz on topic shoal")
        now[0] = 4000.0
        lib.warning("Failed to store value at peer 12D3KooWZyXwVuTsRqPnMkJhGfEdCbA1: dial /ip4/10.0.0.1/tcp/1 failed")
        for _ in range(3):
            lib.warning("Failed to store value at peer 12D3KooWZyXwVuTsRqPnMkJhGfEdCbA1: refused")
    finally:
        lib.removeHandler(handler)
        lib.propagate = True
    handler.close()
    lines = (tmp_path / "node.log").read_text().splitlines()
    stores = [ln for ln in lines if "Failed to store value" in ln and "dial" in ln]
    assert len(stores) == 6 and stores[-1].endswith("[95 more like this left out since the last one written]")
    assert sum("IHAVE rate limit" in ln for ln in lines) == 1
    assert sum("refused" in ln for ln in lines) == 3  # another kind: its own quota
    assert kind_of(logging.LogRecord("x", 30, "", 0, "peer 12D3KooWAbCdEfGhJkLmNpQrStUvWxYz at /ip4/1.2.3.4/tcp/5",
                                     None, None))[2] == "peer # at #"
    assert LogFile(2).quota is None


def test_a_librarys_record_is_one_line_without_its_traceback_below_vv(tmp_path):
    """py-libp2p logs a connection that arrives while the host shuts down with a LifecycleError traceback, and a
    failed stream with a multi-line dump: one line each in the log file (-vv keeps them whole); shoal's own records
    keep their tracebacks."""
    import logging
    import traceback

    from shoal.node.cli.logs import LogFile

    for verbosity, lines in ((0, 4), (2, 8)):
        handler = LogFile(verbosity)
        handler.open(tmp_path / f"v{verbosity}.log")
        lib, ours = logging.getLogger("libp2p.network.swarm"), logging.getLogger("shoal.test.logs")
        for lg in (lib, ours):
            lg.addHandler(handler)
            lg.propagate = False
        try:
            try:
                raise RuntimeError("Cannot schedule task after service has stopped")
            except RuntimeError:
                lib.warning("[ADDCONN_FAIL] add_conn failed for peer X", exc_info=True)
            lib.error("Failed to open stream to peer X:\n  Timeout: 30s\n  Connection: Yamux")
            try:  # py-libp2p 0.4's add_conn writes the traceback into the message itself
                raise RuntimeError("Cannot schedule task after service has stopped")
            except RuntimeError as e:
                lib.warning("[ADDCONN_FAIL] add_conn failed for peer %s: %r\n%s", "Y", e, traceback.format_exc())
            try:
                raise KeyError("ours")
            except KeyError:
                ours.warning("a shoal warning", exc_info=True)
        finally:
            for lg in (lib, ours):
                lg.removeHandler(handler)
                lg.propagate = True
        handler.close()
        text = (tmp_path / f"v{verbosity}.log").read_text()
        assert len(text.splitlines()) >= lines, text
        if verbosity == 0:
            assert "add_conn failed for peer X [RuntimeError: Cannot schedule task after service has stopped]" in text
            assert "Failed to open stream to peer X: · Timeout: 30s · Connection: Yamux" in text
            assert "add_conn failed for peer Y: RuntimeError('Cannot schedule task after service has stopped') [its " \
                   "traceback left out: -vv writes it]" in text
            assert text.count("Traceback") == 1 and "KeyError: 'ours'" in text  # shoal's own, in full
        else:
            assert text.count("Traceback") == 3  # -vv: the library's two, and shoal's


def test_log_files_rotate_by_size_and_keep_a_bounded_number(tmp_path):
    import logging

    from shoal.node.cli.logs import LogFile

    handler = LogFile(0, max_bytes=2_000, keep=2)
    handler.open(tmp_path / "node.log")
    rec = logging.LogRecord("shoal.test", logging.INFO, __file__, 1, "line %04d " + "x" * 80, None, None)
    for i in range(100):  # ~12 KB of records
        rec.args = (i,)
        handler.emit(rec)
    handler.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["node.log", "node.log.1", "node.log.2"], files
    assert all((tmp_path / f).stat().st_size <= 2_000 for f in files)
    assert "line 0099" in (tmp_path / "node.log").read_text()  # the newest records in the current file
    numbers = [[int(ln.split("line ")[1][:4]) for ln in (tmp_path / f).read_text().splitlines()]
               for f in ("node.log.2", "node.log.1", "node.log")]
    assert sum(numbers, []) == list(range(numbers[0][0], 100)) and numbers[0][0] > 0  # in order; the oldest gone


def test_libp2p_messages_go_to_the_log_file_not_the_terminal_unless_verbose(tmp_path):
    """py-libp2p resets its logger when imported (after shoal set logging up): its warnings still land in the log
    file, and on the terminal only with -v."""
    script = textwrap.dedent(f"""
        import logging, sys
        from shoal.node.cli.logs import setup_logging
        handler = setup_logging(int(sys.argv[1]))
        handler.open({str(tmp_path / "node.log")!r})
        import libp2p  # resets the "libp2p" logger: no handlers, no propagation
        logging.getLogger("libp2p.kad_dht.kad_dht").warning("FIND_NODE key is not a valid PeerId (65 bytes)")
        logging.getLogger("shoal.node.daemon").error("a shoal error")
        logging.getLogger("shoal.node.daemon").warning("a routine shoal warning")
    """)
    quiet = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "error: a shoal error\n"
    log = (tmp_path / "node.log").read_text()
    assert "WARNING libp2p.kad_dht.kad_dht: FIND_NODE key is not a valid PeerId" in log
    assert "a routine shoal warning" in log
    loud = subprocess.run([sys.executable, "-c", script, "1"], capture_output=True, text=True, timeout=60)
    assert "FIND_NODE key is not a valid PeerId" in loud.stderr and "a routine shoal warning" in loud.stderr


# -- one node per identity, one process per port -----------------------------------------------------------------
def test_an_identity_is_locked_and_the_default_moves_to_a_free_one(tmp_path):
    first = default_identity(tmp_path)
    assert first.key_path == tmp_path / "identity.key"
    with pytest.raises(IdentityInUse, match=f"pid {os.getpid()}"):
        lock_identity(tmp_path / "identity.key")
    second = default_identity(tmp_path)
    assert second.key_path == tmp_path / "identity-2.key"
    first.release()
    lock_identity(tmp_path / "identity.key").release()  # free again once released
    second.release()


def test_a_taken_port_is_refused_even_though_libp2p_binds_with_so_reuseport(tmp_path):
    """Another process listens with SO_REUSEPORT (as py-libp2p does): the probe refuses the port, and after a bind
    that shares it, the listener count says so."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import socket, sys
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0)); s.listen()
        print(s.getsockname()[1], flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        listen = f"/ip4/127.0.0.1/tcp/{port}"
        with pytest.raises(AddressInUse, match="address already in use"):
            check_free(listen)
        with socket.socket() as shared:  # what py-libp2p would do after the probe, in a race
            shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            shared.bind(("127.0.0.1", port))
            shared.listen()
            with pytest.raises(AddressInUse):
                check_sole_listener(listen)
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
        holder.stdout.close()
    check_free(listen)  # free again
    check_free("/ip4/127.0.0.1/tcp/0")


# -- tables and help ---------------------------------------------------------------------------------------------
def _render(table) -> list[str]:
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(table)
    return console.export_text().splitlines()


def test_the_swarm_and_peers_tables_fit_80_columns_with_whole_headers():
    from shoal.node.cli.peers import peers_table
    from shoal.node.cli.swarm import table
    from shoal.protocol.display import short_id

    pid = "12D3KooWNUE4weiU19J2NWGPTrFShoum5XrPupyrByoohtALKTqJ"
    rows = [dict(index=i, peer_id=pid, pid=4_123_456, alive=i != 2, state="training", role="broker", peers_seen=3,
                 exit="SIGKILL", slot="s0r1", step=123456, loss=3.21, eval_loss=3.3, tokens_per_s=12345.0,
                 bytes_sent=123_456_789, compression_ratio=117.3) for i in range(4)]
    lines = _render(table(rows, 4, "title", True))
    header = next(ln for ln in lines if ln.startswith("#"))
    assert max(map(len, lines)) <= 80 and "…" not in header
    assert all(col in header.split() for col in ("peer", "pid", "role", "state", "slot", "step", "loss", "sent"))
    assert short_id(pid) in lines[3] and "123 MB" in lines[3]
    assert "gone" in next(ln for ln in lines if ln.startswith("2 "))  # a killed node says so
    assert "warm-up" in "".join(lines)  # the cumulative ratio says it counts warm-up steps
    peers = [dict(peer_id=pid, role="active", slot="s0r12", state="training", step=12345, run_id="5b7213" + "a" * 58,
                  device="cuda: NVIDIA H100 80GB HBM3", matmul_tflops=612.3, last_seen_s=1.0,
                  addrs=["/ip4/203.100.100.200/tcp/40001/p2p/" + pid])]
    lines = _render(peers_table(peers))
    header = next(ln for ln in lines if ln.startswith("peer"))
    assert max(map(len, lines)) <= 80 and "…" not in header and short_id(pid) in lines[3] and "5b7213" in lines[3]
    from shoal.node.cli.runs import runs_table

    runs = [dict(run_id="5b7213" + "a" * 58, name="a long run name here", model="small", params=25_000_000, stages=2,
                 lanes=12, free_lanes=52, sync="cocktail", step=123456, total_steps=200000, join="allowlist")]
    lines = _render(runs_table(runs))
    header = next(ln for ln in lines if ln.startswith("id"))
    assert max(map(len, lines)) <= 80 and "…" not in header and "5b7213aa" in lines[3] and "12x2" in lines[3]


def test_the_end_of_a_run_counts_lanes_and_tells_each_way_nodes_ended():
    """A pipeline of 2 stages x 2 lanes has 2 replicas (not 4); the run's held-out loss is the replicas' mean, with
    their spread; a stop before anyone trained gives no verdict on hashes; exit codes by kind, with the nodes."""
    from shoal.node.cli.swarm import exits_line, outcome_line, run_summary

    # stopped mid-run, the replicas are a step apart: their hashes are compared at the newest step both hold
    rows = [dict(index=i, alive=True, slot=f"s{s}r{r}", step=40 + r, state_hash=f"h{s}-{40 + r}",
                 recent_hashes={str(k): f"h{s}-{k}" for k in range(30, 41 + r)},
                 eval_loss=(3.0 + r / 10 if s == 1 else None)) for i, (s, r) in enumerate([(0, 0), (1, 0), (0, 1),
                                                                                           (1, 1)])]
    rows.append(dict(index=4, alive=True, slot=None, step=0))  # a backup
    run = run_summary(rows, 60.0, 50.0, stages=2)
    assert (run["replicas"], run["stages"], run["active_nodes"], run["steps"]) == (2, 2, 4, 40)
    assert run["hashes_agree"] is True and run["eval_loss"] == 3.05 and run["eval_loss_spread"] == 0.1
    assert outcome_line(run).startswith("2 replicas of 2 stages reached step 40") and "hashes agree" in outcome_line(run)
    rows[2]["recent_hashes"]["40"] = "h0-other"
    assert run_summary(rows, 60.0, 50.0, stages=2)["hashes_agree"] is False
    starting = run_summary([dict(index=0, alive=True, slot="s0r0", step=0, state_hash=None)], 3.0, None)
    assert starting["hashes_agree"] is None and outcome_line(starting) == "stopped before any replica trained a step"
    assert exits_line({0: 0, 1: -9, 2: 0, 3: 0}) == "stopped 4 nodes: 3 exit 0, 1 SIGKILL (node 1)"
    assert exits_line({0: 0, 1: 2, 2: 2}) == "stopped 3 nodes: 1 exit 0, 2 exit 2 (nodes 1, 2)"


def test_old_swarm_folders_are_pruned_keeping_the_last_n(tmp_path):
    import time

    from shoal.node.cli.swarm import new_swarm_dir

    root = tmp_path / "swarms"
    for i in range(12):
        (root / f"2026010{i % 9 + 1}-1200{i:02d}").mkdir(parents=True)
        os.utime(root / f"2026010{i % 9 + 1}-1200{i:02d}", (1000 + i, 1000 + i))
    (root / "mine").mkdir()  # not a folder swarm up made: never removed
    now = time.time()
    path, removed = new_swarm_dir(root, 10, now)
    assert [p.name for p in removed] == [f"2026010{i % 9 + 1}-1200{i:02d}" for i in range(3)]  # the oldest three
    assert len([p for p in root.iterdir() if p.name != "mine"]) == 10 and (root / "mine").exists() and path.exists()
    again, _ = new_swarm_dir(root, 10, now)  # within the same second: a folder of its own
    assert again != path and again.name.startswith(path.name) and again.exists() and path.exists()


def _parsers(parser: argparse.ArgumentParser, path: str):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_option_has_help_and_says_its_default_once():
    from shoal.node.cli import build_parser

    root = build_parser()
    assert "exit status:" in root.format_help() and " 11  the --listen port" in root.format_help()
    for path, parser in _parsers(root, "shoal"):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{path} {action.option_strings or action.dest}: no help"
            assert (action.help or "").count("default:") <= 1, f"{path} {action.option_strings}"
        assert "(default: None)" not in parser.format_help(), path
    create = dict(_parsers(root, "shoal"))["shoal run create"]
    assert "shoal run create --replicas 4" in create.format_help() and "hf:NAME" in create.format_help()


def test_verbose_works_after_the_subcommand_too():
    from shoal.node.cli import build_parser, verbosity

    assert verbosity(build_parser().parse_args(["node", "-v"])) == 1
    assert verbosity(build_parser().parse_args(["-v", "swarm", "up", "-v"])) == 2
    assert verbosity(build_parser().parse_args(["run", "show", "x.toml"])) == 0


def test_help_documents_every_exit_status():
    text = subprocess.run([*SHOAL, "--help"], capture_output=True, text=True, timeout=60).stdout
    for code in Exit:
        assert re.search(rf"^\s+{int(code)}\s+\S", text, re.M), code
