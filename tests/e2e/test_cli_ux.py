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
