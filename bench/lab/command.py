"""`shoal bench codecs|convergence|pipeline|placement|network`: codecs beside hivemind's; synchronizers side by side;
one lane's pipeline; placement planners on DT-FM's scenarios; shaped links."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP = "benchmarks (writes JSON and a Markdown table under bench/results/)"
RESULTS = Path("bench") / "results"  # under the current folder: run from a checkout, the repository's results
REGIMES = ("scratch", "continued")  # shoal.bench.convergence.REGIMES (imported lazily: it needs torch)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="WHAT", required=True)
    c = sub.add_parser("codecs", help="compression codecs on a heavy-tailed gradient")
    c.add_argument("--numel", type=int, default=25_000_000, help="input size in float32 values")
    c.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradient (default: %(default)s)")
    c.add_argument("--repeats", type=int, default=3, help="timed runs per codec (median reported) after one warm-up")
    c.add_argument("--out", type=Path, default=RESULTS, help="folder for codecs.json and codecs.md")
    c.add_argument("--name", default="codecs", help="basename of the result files")
    c.add_argument("--threads", type=int, default=1, help="torch threads for both sides (1: stable on a shared machine)")
    c.add_argument("--hivemind-python", default=None, help="python of a venv with hivemind (default: $SHOAL_HOME/venv-bench-hivemind, made on first use)")
    c.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline")
    v = sub.add_parser("convergence", help="D replicas on loopback under allreduce, cocktail and diloco variants",
                       description="The synchronizers side by side at equal steps: held-out loss and bytes per node, "
                                   "from scratch and continuing from a common pretrained model, with two controls "
                                   "(one replica alone; uncompressed model averaging every step).")
    v.add_argument("--steps", type=int, default=1000, help="optimizer steps per variant")
    v.add_argument("--init-steps", type=int, default=2000,
                   help="the continued regime's pretraining: steps of one replica alone")
    v.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=REGIMES,
                   help="from scratch, and/or continuing from a common pretrained model (default: both)")
    v.add_argument("--replicas", type=int, default=4, help="data-parallel replicas D (default: %(default)s)")
    v.add_argument("--seed", type=int, default=0, help="model initialization and data order (default: %(default)s)")
    v.add_argument("--d-model", type=int, default=64, help="the model's width (default: %(default)s)")
    v.add_argument("--layers", type=int, default=2, help="the model's layers (default: %(default)s)")
    v.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    v.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)g)")
    v.add_argument("--cocktail", type=cocktail_setting, action="append", metavar="P,R,B",
                   help="a cocktail variant's mask fraction, top-k fraction and bits (repeat for several; "
                        "default: 0.1,0.2,4)")
    v.add_argument("--cocktail-warmup", type=warmup_setting, action="append", metavar="N:BITS", default=[],
                   help="also run each cocktail variant after a warm-up of N all-reduced steps, their gradients "
                        "quantized to BITS (2, 4, 8) with error feedback or uncompressed (32); repeat for several")
    v.add_argument("--inner-steps", type=int, default=50, help="DiLoCo H for the fp32 variant")
    v.add_argument("--inner-steps-e3m0", type=int, default=100, help="DiLoCo H for the E3M0 variants")
    v.add_argument("--fragments", type=int, default=2, help="Streaming DiLoCo fragments")
    v.add_argument("--overlap", type=int, default=5, help="Streaming DiLoCo tau (inner steps during the all-reduce)")
    v.add_argument("--alpha", type=float, default=0.5, help="Streaming DiLoCo merge of local parameters")
    v.add_argument("--timeout", type=float, default=60.0, help="round deadline in seconds")
    v.add_argument("--compare-robust", action="store_true",
                   help="also run every networked variant with robust aggregation off")
    v.add_argument("--poison", type=float, default=None, metavar="F",
                   help="also run every networked variant with replica 0 multiplying the updates it sends by F "
                        "(negative: sign-flipped)")
    v.add_argument("--only", nargs="*", default=(), help="run only variants whose label contains one of these "
                                                         "(all-reduce, the baseline, always runs)")
    v.add_argument("--out", type=Path, default=RESULTS,
                   help="folder for the result files (default: bench/results)")
    v.add_argument("--name", default="convergence", help="basename of the result files")
    pl = sub.add_parser("pipeline", help="one lane of S stages over real links: tokens/s, loss, bytes, bubble",
                        description="One lane of S = 1, 2, 4 stages, each a real libp2p host on 127.0.0.1 with its "
                                    "own trainer thread, activations at fp32 and fp16 on the wire: tokens/s and "
                                    "held-out loss at equal steps, bytes per micro-batch per link against the "
                                    "formula, the measured bubble against GPipe's (S-1)/(M+S-1).")
    pl.add_argument("--stages", default="1,2,4", help="comma-separated stage counts (default: 1,2,4)")
    pl.add_argument("--wire", default="fp32,fp16", help="comma-separated wire dtypes (default: fp32,fp16)")
    pl.add_argument("--steps", type=int, default=60, help="optimizer steps per configuration (default: 60)")
    pl.add_argument("--layers", type=int, default=4, help="model layers (default: 4)")
    pl.add_argument("--d-model", type=int, default=128, help="model width (default: 128)")
    pl.add_argument("--compression", default="none",
                    help="comma-separated: none (at each --wire dtype), aqsgd (fw4/bw8), aqsgd-fv16 (first visits "
                         "fp16), aqsgd-fw2bw4, direct2 "
                         "(every visit quantized directly at 2 bits: the control) (default: none)")
    pl.add_argument("--train-subset", type=int, default=0, metavar="N",
                    help="train on N samples epoch after epoch (AQ-SGD needs samples to come back; default: all)")
    pl.add_argument("--out", type=Path, default=RESULTS, help="folder for the result files")
    pl.add_argument("--name", default="pipeline", help="basename of the result files (default: pipeline)")
    pc = sub.add_parser("placement", help="shoal's planner vs random, greedy and DT-FM's GCMA on DT-FM's scenarios",
                        description="Places 64 devices into 8 stages x 8 lanes on each of DT-FM's five scenarios "
                                    "with random partitions (mean of 100), nearest-neighbour lanes, a faithful GCMA "
                                    "(DT-FM's memetic search; 100 + 4,900 candidates per seed, minutes per run) and "
                                    "shoal's planner, all priced by one cost model. Prints per case the predicted "
                                    "step time (DP, PP, total), the ratios to GCMA and to random, and the planning "
                                    "time; writes JSON and Markdown.",
                        epilog="example: shoal bench placement --cases 5_worldwide --seeds 0 (one GCMA run, ~2 min)")
    pc.add_argument("--cases", default="", help="comma-separated case names (default: all five: "
                                                "1_datacenter_on_demand, 2_datacenter_spot, 3_multi_university, "
                                                "4_regional_us, 5_worldwide)")
    pc.add_argument("--seeds", default="0,1,2", help="GCMA seeds, comma-separated; empty: no GCMA (default: 0,1,2)")
    pc.add_argument("--offspring", type=int, default=4900, help="GCMA offspring per run (default: %(default)s)")
    pc.add_argument("--population", type=int, default=100, help="GCMA population (default: %(default)s)")
    pc.add_argument("--random", type=int, default=100, help="random partitions per case (default: %(default)s)")
    pc.add_argument("--budget", type=float, default=1.5, help="shoal planner's time budget in seconds "
                                                              "(default: %(default)s)")
    pc.add_argument("--out", type=Path, default=RESULTS, help="folder for the result files (default: bench/results)")
    pc.add_argument("--name", default="placement", help="basename of the result files (default: placement)")
    pc.add_argument("--keep", action="store_true",
                    help="take random and GCMA results of cases already in the result file (same seeds, population, "
                         "offspring and random samples) instead of running them again, and keep its other cases: "
                         "a long run one case at a time")
    pl2 = sub.add_parser("placement-live", help="placement by the network on a live swarm in two namespace sites",
                         description="N nodes in two sites (fast inside, a slow link between) started so that "
                                     "first-fit seating strings every lane across the slow link. Scenarios: gain "
                                     "(tokens/s with the network planner vs first fit, same run), throttle (one "
                                     "node's link drops: time until the run moves), noise (+-20 %% on every link "
                                     "for 10 minutes: moves made). Needs root; CPU-heavy: one scenario at a time.")
    pl2.add_argument("--scenario", required=True, choices=("gain", "throttle", "noise"),
                     help="gain: tokens/s by the network vs first fit; throttle: one node's link drops, time until the "
                          "run moves; noise: +-20 %% on every link, moves made")
    pl2.add_argument("--nodes", type=int, default=8, help="active nodes, S = 2 (default: %(default)s; throttle "
                                                           "adds a backup)")
    pl2.add_argument("--between-mbit", type=float, default=10.0, help="the link between the sites (default: 10)")
    pl2.add_argument("--window", type=int, default=30, help="steps measured (default: %(default)s)")
    pl2.add_argument("--replan-every", type=float, default=10.0, help="the broker's --replan-every (default: 10)")
    pl2.add_argument("--move-every", type=float, default=20.0, help="the broker's --move-every (default: 20)")
    pl2.add_argument("--noise-s", type=float, default=600.0, help="noise scenario: seconds of noise (default: 600)")
    pl2.add_argument("--workdir", type=Path, default=None, help="node logs and status files (default: a temp dir)")
    pl2.add_argument("--out", type=Path, default=RESULTS, help="folder for the result files (default: bench/results)")
    pl2.add_argument("--name", default="placement_live", help="basename of the result files, whose other "
                                                               "scenarios are kept (default: placement_live)")
    n = sub.add_parser("network", help="nodes in network namespaces on shaped links, unshaped, and hivemind beside",
                       description="N shoal nodes, each in its own network namespace, train over links shaped by tbf "
                                   "(per node and direction) for each scenario, then unshaped (the limit), and "
                                   "hivemind on the same links. Needs root. Writes JSON and Markdown.",
                       epilog="scenarios: " + ", ".join(_scenario_names()) + ". workloads: allreduce, "
                              "allreduce-fp16, cocktail, diloco-e3m0, streaming-diloco, pipeline-fp32, "
                              "pipeline-aqsgd (S=2, one lane per 2 nodes)")
    n.add_argument("--scenario", default="home-100", help="comma-separated scenario names or JSON files")
    n.add_argument("--sync", default="cocktail,allreduce", help="comma-separated workloads")
    n.add_argument("--baseline", default="", help="hivemind: also train with hivemind (default averaging and 8-bit)")
    n.add_argument("--size", default="tiny", choices=("tiny", "small"), help="model preset (default: %(default)s)")
    n.add_argument("--layers", type=int, default=None,
                   help="the preset's width with this many layers (default: the preset's own; tiny has 2)")
    n.add_argument("--nodes", type=int, default=4, help="nodes, each in its own namespace (default: %(default)s)")
    n.add_argument("--steps", type=int, default=None, help="steps per segment at most (tiny 120, small 6)")
    n.add_argument("--window", default=None, metavar="A,B",
                   help="measure throughput, bytes and CPU from step A to B (tiny 20,80; small 2,5)")
    n.add_argument("--target-loss", type=float, default=None,
                   help="held-out loss to time (tiny 2.8; small: none)")
    n.add_argument("--no-target", action="store_true", help="time no target loss (throughput and bytes only)")
    n.add_argument("--hivemind-compression", default="none,8bit",
                   help="hivemind variants: none (its default), fp16, 8bit (default: none,8bit)")
    n.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)g)")
    n.add_argument("--segment-time", type=float, default=None, help="training seconds per segment at most "
                                                                     "(tiny 240, small 900)")
    n.add_argument("--status-interval", type=float, default=2.0, help="the nodes' --status-interval (default 2)")
    n.add_argument("--no-limit", action="store_true", help="skip the unshaped segments")
    n.add_argument("--hivemind-python", default=None, help="python of a venv with hivemind (default: "
                                                           "$SHOAL_HOME/venv-bench-hivemind, made on first use)")
    n.add_argument("--budget", type=float, default=1680.0, help="seconds after which no segment starts (28 min)")
    n.add_argument("--prefix", default="shnet", help="names of the namespaces, veths and bridge start with this")
    n.add_argument("--subnet", default="10.15.0", help="the /24 inside the namespaces (first three octets)")
    n.add_argument("--workdir", type=Path, default=None, help="node logs and status files (default: a temp dir)")
    n.add_argument("--out", type=Path, default=RESULTS / "network",
                   help="folder for the result files (default: bench/results/network)")
    n.add_argument("--name", default=None, help="basename of the result files (default: the scenario names)")


def _scenario_names() -> list[str]:
    from shoal.bench.scenarios import available  # torch-free

    return available()


def write_results(out: Path, name: str, doc: dict, md: str, *, indent: int = 1) -> None:
    """A benchmark's result files, NAME.json and NAME.md under `out`; the Markdown is printed too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=indent) + "\n")
    (out / f"{name}.md").write_text(md)
    print(md)


def command_line() -> str:
    """This invocation as a reader would retype it (`python -m shoal.node.cli` is the `shoal` command)."""
    prog = Path(sys.argv[0])
    name = "shoal" if prog.name == "shoal" or prog.parts[-3:] == ("node", "cli", "__main__.py") else prog.name
    return " ".join([name, *(shlex.quote(a) for a in sys.argv[1:])])


def cocktail_setting(text: str) -> tuple[float, float, int]:
    """'P,R,B' (e.g. 0.1,0.2,4) for --cocktail."""
    try:
        sp, sr, sb = text.split(",")
        return float(sp), float(sr), int(sb)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected P,R,B such as 0.1,0.2,4") from None


def warmup_setting(text: str) -> tuple[int, int]:
    """'N:BITS' (e.g. 50:2) for --cocktail-warmup."""
    try:
        n, bits = text.split(":")
        return int(n), int(bits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N:BITS such as 50:2") from None


def heavy_tailed(numel: int, seed: int):
    """Student-t (3 degrees of freedom) float32 values, deterministic from the seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(numel, generator=g)
    chi2 = torch.randn(numel, generator=g).square_()
    for _ in range(2):
        chi2.add_(torch.randn(numel, generator=g).square_())
    return z.div_(chi2.div_(3).sqrt_()).mul_(1e-3)


def shoal_codecs(numel: int):
    """name -> (run: x -> (wire bytes, reconstruction)), each including compress and decompress."""
    import torch

    from shoal.kernels.codec import CastCodec, E3M0Codec, QuantCodec
    from shoal.kernels.cocktail import CocktailCompressor, CocktailConfig

    def dense(codec):
        def run(x):
            e = codec.encode(x)
            return e.nbytes, codec.decode(e)
        return run

    def cocktail(cfg):
        comp = CocktailCompressor(numel, cfg)
        out = torch.zeros(numel)

        def run(x):
            m = comp.mask(step=7)
            e = comp.compress(m.gather(x).to(torch.float16))  # delta in fp16, as the workers send it
            out.zero_()
            m.add_(out, comp.decompress(e))  # what a worker applies: dense update on the masked coordinates
            return e.nbytes, out
        return run

    copy_out = torch.empty(numel)

    def copy(x):
        copy_out.copy_(x)
        return numel * 4, copy_out

    return {
        "tensor copy (limit)": copy,
        "shoal fp16": dense(CastCodec(torch.float16)),
        "shoal bf16": dense(CastCodec(torch.bfloat16)),
        "shoal Q8 (bucket 128)": dense(QuantCodec(8)),
        "shoal Q4 (bucket 128)": dense(QuantCodec(4)),
        "shoal Q4 stochastic": dense(QuantCodec(4, stochastic=True)),
        "shoal Q3 (bucket 128)": dense(QuantCodec(3)),
        "shoal Q2 (bucket 128)": dense(QuantCodec(2)),
        "shoal E3M0 (bucket 128)": dense(E3M0Codec()),
        "shoal CocktailSGD p=0.1 r=0.2 b=4": cocktail(CocktailConfig(p=0.1, r=0.2, bits=4)),
        "shoal CocktailSGD p=0.4 r=0.5 b=4": cocktail(CocktailConfig(p=0.4, r=0.5, bits=4)),
    }


def measure(name, run, x, repeats: int) -> dict:
    import statistics

    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        nbytes, y = run(x)
        dt = time.perf_counter() - t0
        if i:
            times.append(dt)
    t = statistics.median(times)
    n = x.numel()
    err = float((x - y.float()).norm() / x.norm())
    return {"codec": name, "seconds": t, "gbps": n * 4 / t / 1e9, "bits_per_element": 8 * nbytes / n,
            "rel_error": err, "wire_bytes": nbytes}


def run_hivemind(py: str, x, repeats: int) -> dict:
    import torch

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "input.pt")
        torch.save(x, path)
        from shoal.bench.hivemind_swarm import CODECS_SCRIPT

        cmd = [py, "-W", "ignore", str(CODECS_SCRIPT), "--input", path, "--repeats", str(repeats),
               "--threads", str(torch.get_num_threads())]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        return {"error": f"baseline exited {r.returncode}: {r.stderr[-500:]}"}
    return json.loads(r.stdout)


def markdown(result: dict) -> str:
    lines = ["# shoal bench codecs", "", f"Command: `{result['command']}`", "",
             f"Input: {result['numel']:,} float32 values, Student-t (3 d.o.f.), seed {result['seed']}; "
             f"{result['threads']} torch threads on {result['machine']}; median of {result['repeats']} runs "
             "of compress+decompress. GB/s counts fp32 input bytes. CocktailSGD error is over the whole tensor "
             "(it sends ~2% of coordinates; error feedback keeps the rest).", "",
             "| codec | GB/s | bits/element | x fewer bytes than fp32 | rel. error |", "|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['codec']} | n/a: {r['error'].splitlines()[0][:90]} | | | |")
            continue
        lines.append(f"| {r['codec']} | {r['gbps']:.3f} | {r['bits_per_element']:.4f} | "
                     f"{32 / r['bits_per_element']:.1f} | {r['rel_error']:.2e} |")
    lines += ["", "## Targets", ""] + [f"- {t}" for t in result["targets"]]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    import platform

    import torch

    if args.bench == "convergence":
        return convergence(args)
    if args.bench == "network":
        return network(args)
    if args.bench == "pipeline":
        return pipeline(args)
    if args.bench == "placement":
        return placement(args)
    if args.bench == "placement-live":
        return placement_live(args)
    if args.bench != "codecs":
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    x = heavy_tailed(args.numel, args.seed)
    rows = [measure(name, run, x, args.repeats) for name, run in shoal_codecs(args.numel).items()]
    hm_info = None
    if not args.no_hivemind:
        from shoal.bench.hivemind_swarm import baseline_python

        py, how = baseline_python(args.hivemind_python)
        if py is None:
            rows.append({"codec": "hivemind (all)", "error": how})
        else:
            hm = run_hivemind(py, x, args.repeats)
            if "error" in hm:
                rows.append({"codec": "hivemind (all)", "error": hm["error"]})
            else:
                rows += hm["rows"]
                hm_info = {"python": py, "how": how, "version": hm["hivemind_version"], "torch": hm["torch"]}
    by = {r["codec"]: r for r in rows if "error" not in r}
    ck = by["shoal CocktailSGD p=0.1 r=0.2 b=4"]
    targets = [f"CocktailSGD p=0.1 r=0.2 b=4 sends {32 / ck['bits_per_element']:.1f}x fewer bytes than fp32 "
               f"(target >= 150x): {'met' if 32 / ck['bits_per_element'] >= 150 else 'NOT met'}"]
    u8 = by.get("hivemind Uniform8Bit")
    if u8:
        ratio = ck["gbps"] / u8["gbps"]
        targets.append(f"CocktailSGD CPU throughput is {ratio:.1f}x hivemind Uniform8Bit's (target >= 1x): "
                       f"{'met' if ratio >= 1 else 'NOT met'}")
    else:
        targets.append("hivemind Uniform8Bit not measured: throughput target not checked")
    targets.append("GPU fast path vs device copy: measured on a GPU by bench/bench_gpu_kernels.py "
                   "(bench/results/gpu_kernels.md)")
    result = {
        "command": command_line(),
        "numel": args.numel, "seed": args.seed, "repeats": args.repeats, "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}", "hivemind": hm_info,
        "rows": rows, "targets": targets,
    }
    write_results(args.out, args.name, result, markdown(result), indent=2)
    return 0


def placement(args: argparse.Namespace) -> int:
    """`shoal bench placement`: the runner lives in bench/lab/placement_bench.py."""
    import platform

    from shoal.bench import placement_bench

    try:
        config = placement_bench.PlacementBenchConfig(
            cases=tuple(x for x in args.cases.split(",") if x), gcma_seeds=tuple(int(x) for x in args.seeds.split(",")
                                                                                 if x.strip()),
            population=args.population, offspring=args.offspring, random_samples=args.random, budget_s=args.budget)
        placement_bench.load_cases(config.cases)
    except ValueError as e:
        print(f"shoal bench placement: {e}", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    earlier = None
    path = args.out / f"{args.name}.json"
    if args.keep and path.exists():
        try:
            earlier = json.loads(path.read_text())
        except ValueError as e:
            print(f"shoal bench placement: --keep: {path} is not a result file ({e})", file=sys.stderr)
            return 2
    doc = placement_bench.run(config, progress, earlier)
    doc["command"] = command_line()
    doc["commands"] = doc.pop("earlier_commands") + [doc["command"]]
    doc["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs, numpy single process"
    write_results(args.out, args.name, doc, placement_bench.markdown(doc))
    return 0


def placement_live(args: argparse.Namespace) -> int:
    """`shoal bench placement-live`: the runner lives in bench/lab/placement_live.py."""
    import dataclasses
    import logging
    import platform

    from shoal.bench import placement_live as pl
    from shoal.bench.netns import NetnsError
    from shoal.bench.topology import install_signal_teardown

    try:
        cfg = pl.LiveConfig(nodes=args.nodes, between_mbit=args.between_mbit, window_steps=args.window,
                            replan_every_s=args.replan_every, move_every_s=args.move_every, noise_s=args.noise_s)
    except ValueError as e:
        print(f"shoal bench placement-live: {e}", file=sys.stderr)
        return 2
    logging.getLogger("shoal.bench").setLevel(logging.WARNING)
    install_signal_teardown()

    def progress(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shoal-bench-placement-live-"))
    try:
        result = pl.RUNNERS[args.scenario](cfg, workdir, workdir / "home", progress)
    except (NetnsError, RuntimeError, TimeoutError) as e:
        print(f"shoal bench placement-live: {type(e).__name__}: {e} (node logs in {workdir})", file=sys.stderr)
        return 1
    result["config"] = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("prefix", "subnet")}
    path = args.out / f"{args.name}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"scenarios": {}, "commands": []}
    doc["scenarios"][args.scenario] = result
    doc["commands"] = [c for c in doc.get("commands", []) if f"--scenario {args.scenario}" not in c] + \
        [command_line()]
    doc["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs, 1 torch thread per node"
    write_results(args.out, args.name, doc, pl.markdown(doc))
    return 0


def pipeline(args: argparse.Namespace) -> int:
    """`shoal bench pipeline`: the runner lives in bench/lab/pipeline_bench.py."""
    from shoal.bench import pipeline_bench

    try:
        config = pipeline_bench.PipelineBenchConfig(
            stages=tuple(int(x) for x in args.stages.split(",")), wire=tuple(args.wire.split(",")),
            steps=args.steps, layers=args.layers, d_model=args.d_model,
            compression=tuple(args.compression.split(",")), train_subset=args.train_subset)
    except ValueError as e:
        print(f"shoal bench pipeline: {e}", file=sys.stderr)
        return 2
    pipeline_bench.run(config, args.out, args.name, command_line())
    print(f"wrote {args.out / (args.name + '.md')}")
    return 0


def convergence(args: argparse.Namespace) -> int:
    """`shoal bench convergence`: the runner lives in node/sync_bench.py; this writes the results."""
    import platform

    import torch

    from shoal.bench import convergence as sync_bench

    try:
        config = sync_bench.BenchConfig(
            steps=args.steps, init_steps=args.init_steps, regimes=tuple(args.regimes), replicas=args.replicas,
            seed=args.seed, d_model=args.d_model, layers=args.layers, batch=args.batch, lr=args.lr,
            h=args.inner_steps, h_e3m0=args.inner_steps_e3m0, fragments=args.fragments, overlap=args.overlap,
            alpha=args.alpha, timeout_s=args.timeout, only=tuple(args.only), compare_robust=args.compare_robust,
            poison=args.poison, warmups=tuple(args.cocktail_warmup),
            **({"cocktail": tuple(args.cocktail)} if args.cocktail else {}))
    except ValueError as e:
        print(f"shoal bench convergence: {e}", file=sys.stderr)
        return 2
    rows = sync_bench.run_all(config)
    result = {
        "command": command_line(),
        "config": sync_bench.config_dict(config),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, 1 torch thread per replica",
        "rows": rows, "targets": sync_bench.targets(rows),
    }
    write_results(args.out, args.name, result, sync_bench.markdown(result), indent=2)
    return 0


def network(args: argparse.Namespace) -> int:
    """`shoal bench network`: the runner lives in bench/lab/netbench.py; this writes the results."""
    import logging
    import platform

    import torch

    from shoal.bench import netbench, netreport
    from shoal.bench.netns import NetnsError
    from shoal.bench.segment import SegmentConfig

    small = args.size == "small"
    steps = args.steps or (6 if small else 120)
    window = args.window or ("2,5" if small else "20,80")
    try:
        w0, w1 = (int(x) for x in window.split(","))
        seg = SegmentConfig(size=args.size, layers=args.layers, nodes=args.nodes, max_steps=steps, window_steps=(w0, min(w1, steps)),
                            target_loss=None if args.no_target else args.target_loss if args.target_loss is not None
                            else None if small else 2.8,
                            eval_every=10, lr=args.lr, status_interval_s=args.status_interval,
                            time_limit_s=args.segment_time or (900.0 if small else 240.0),
                            round_timeout_s=300.0 if small else 20.0, start_timeout_s=300.0 if small else 120.0)
        config = netbench.NetBenchConfig(
            scenarios=tuple(x for x in args.scenario.split(",") if x), workloads=tuple(x for x in args.sync.split(",") if x),
            baselines=tuple(x for x in args.baseline.split(",") if x), segment=seg,
            workdir=args.workdir or Path(tempfile.mkdtemp(prefix="shoal-bench-network-")), prefix=args.prefix,
            subnet=args.subnet, limit=not args.no_limit, hivemind_python=args.hivemind_python, budget_s=args.budget,
            hivemind_compressions=tuple(x for x in args.hivemind_compression.split(",") if x))
    except ValueError as e:
        print(f"shoal bench network: {e}", file=sys.stderr)
        return 2
    logging.getLogger("shoal.bench").setLevel(logging.WARNING)

    def progress(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)

    try:
        doc = netbench.run(config, progress)
    except NetnsError as e:
        print(f"shoal bench network: {e}", file=sys.stderr)
        return 1
    doc["command"] = command_line()
    doc["machine"] = f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, 1 torch thread per node"
    doc["targets"] = netreport.targets(doc["rows"])
    name = args.name or "-".join(config.scenarios)
    write_results(args.out, name, doc, netreport.markdown(doc))
    return 0
