"""`shoal run create|show`: write a signed run manifest from flags, or print and verify one."""

from __future__ import annotations

import argparse

from shoal.node.cli.specflags import SpecFlag, add_spec_flags, field_default, spec_field, spec_values
from shoal.protocol.manifest import PIPELINE_COMPRESSION, SYNC_METHODS

HELP = "create or show a run manifest (model, data, parallel plan, compression, join policy)"
DESCRIPTION = (
    "A run is a signed manifest; its content hash is the run id.\n\n"
    "  shoal run create -o run.toml                   the built-in tiny model on the stdlib corpus\n"
    "  shoal run create --size small --steps 20000 -o run.toml\n"
    "  shoal run show run.toml                        print it and check its signature"
)


CREATE_DESCRIPTION = """\
Write a new run manifest, signed with your identity: the model, the data, the
parallel plan (pipeline stages S x data-parallel replicas D), the
synchronization and its compression, the optimizer, and who may join. Its
content hash is the run id; the first node started with the file hosts the
run's broker, and others join with `shoal node --join ADDR` (the swarm's open
run) or `--run NAME`. The run is elastic: it starts with --replicas, seats
volunteers who join later as new replicas up to --max-replicas, and shrinks
when they leave (down to --min-replicas; below it, it waits). Each step trains
on --global-batch sequences, split across the replicas by their speed.

  shoal run create -o run.toml                               tiny GPT, stdlib corpus, 1 replica, up to 8
  shoal run create --replicas 4 -o run.toml                  4 replicas with CocktailSGD, up to 16
  shoal run create --replicas 2 --max-replicas 64 --global-batch 256 -o run.toml
  shoal run create --size small --replicas 8 --steps 20000 --data ~/corpus/ -o run.toml
  shoal run create --replicas 4 --sync diloco --diloco-h 50 -o run.toml
  shoal run create --stages 2 --replicas 2 --size small -o run.toml      # a pipeline of 2 stages x 2 lanes
  shoal run create --replicas 2 --join-secret-file secret.txt -o run.toml   # a private run
  shoal run create --data hf:roneneldan/TinyStories -o run.toml             # a Hugging Face dataset
  shoal run create --model hf:~/models/qwen2-0.5b --stages 2 -o run.toml    # fine-tune a Hugging Face model
  shoal run create --arch llama --layers 4 --d-model 256 --heads 4 \
      --tokenizer tok.json --data corpus.parquet -o run.toml                 # a Llama from scratch

--model hf:PATH: a Hugging Face causal LM (Llama, Mistral, Qwen2, Qwen3,
GPT-2 families): a folder with config.json (and model*.safetensors weights to
fine-tune from, and tokenizer.json, used unless --tokenizer says otherwise),
or a config.json alone (trained from the run's seed). --arch FAMILY builds a
config from --layers/--d-model/--heads (--kv-heads, --ffn). The manifest
records the config and the sha256 of the weights and the tokenizer; the files
are kept under $SHOAL_HOME/blobs/ and nodes fetch them from peers by hash
(never from a path). Needs pip install 'shoal[hf]'.

--data: 'stdlib' (the Python standard library's own source, on every machine),
a .txt file, a .jsonl file (one document per line: a string or {"text": ...}),
a .parquet file, a folder of them, or hf:NAME (a Hugging Face dataset's "train"
split, "text" column; needs pip install 'shoal[hf]' and the network). Every node reads the
source itself, so a file or folder must be at the same path on every machine.
Text is tokenized as bytes, or with --tokenizer (a tokenizer.json).
A .parquet file's text column is --text-field (default "text"); an hf: dataset
takes --data-config and --data-split too, and is streamed: each node reads only
the tokens the run can consume.
"""


#: flags that set one manifest field each: type, choices and default come from the field's spec (protocol/manifest.py)
NAME_FLAGS = (SpecFlag("--name", "name", "a name for people; not used by shoal"),)
MODEL_FLAGS = (SpecFlag("--positions", "model.positions", "position encoding"),)
DATA_FLAGS = (
    SpecFlag("--data", "data.source", "'stdlib', a .txt/.jsonl file or a folder of them, or hf:NAME", "SOURCE"),
)
DATA_FIELD_FLAGS = (
    SpecFlag("--text-field", "data.text_field", "the column (jsonl key) that holds the text", "NAME"),
    SpecFlag("--data-config", "data.hf_config", "hf: dataset configuration (subset)", "NAME"),
    SpecFlag("--data-split", "data.hf_split", "hf: dataset split", "NAME"),
)
OPTIM_FLAGS = (
    SpecFlag("--batch", "batch.batch_size", "a replica's nominal sequences per step: the global batch is this times "
                                            "--replicas unless --global-batch says it", "N"),
    SpecFlag("--steps", "optim.total_steps", "total optimizer steps, the schedule's length", "N"),
    SpecFlag("--lr", "optim.lr", "peak learning rate"),
    SpecFlag("--optimizer", "optim.optimizer", "the inner (local) optimizer"),
    SpecFlag("--warmup", "optim.warmup_steps", "learning-rate warm-up steps", "N"),
    SpecFlag("--weight-decay", "optim.weight_decay", "AdamW weight decay"),
    SpecFlag("--grad-clip", "optim.grad_clip", "gradient norm clipping"),
    SpecFlag("--seed", "seed", "model initialization and data order"),
    SpecFlag("--eval-every", "eval.every_steps", "held-out evaluation every N steps", "N"),
    SpecFlag("--ckpt-every", "checkpoint.every_steps", "checkpoint every N steps", "N"),
    SpecFlag("--keep", "checkpoint.keep_last", "checkpoints to keep", "N"),
    SpecFlag("--snapshot-every", "checkpoint.snapshot_every_steps", "every N steps each stage's state is "
             "erasure-coded into shards held outside the stage, so the stage survives losing every replica (0: never)",
             "N"),
    SpecFlag("--parity", "checkpoint.parity", "parity shards per stage snapshot: the stage comes back with any M of "
                                              "its shard holders gone", "M"),
)
PLAN_FLAGS = (
    SpecFlag("--stages", "plan.stages", "pipeline stages S: the model split into S consecutive pieces on different "
                                        "nodes", "S"),
    SpecFlag("--replicas", "plan.replicas", "data-parallel replicas (lanes) D the run starts with", "D"),
    SpecFlag("--backups", "plan.backups", "warm backups each stage keeps (for fast replacement) before volunteers "
                                          "form new replicas", "N"),
    SpecFlag("--placement", "plan.placement", "who sits where: network places and re-places providers by their "
                                              "measured links and the step-time cost model (docs/placement.md); "
                                              "first-fit (the default) seats them in the order they come"),
)
SYNC_FLAGS = (
    SpecFlag("--cocktail-p", "plan.sync.cocktail.p", "CocktailSGD: share of coordinates kept by the random mask", "P"),
    SpecFlag("--cocktail-r", "plan.sync.cocktail.r", "CocktailSGD: share of those kept by top-k", "R"),
    SpecFlag("--cocktail-bits", "plan.sync.cocktail.bits", "CocktailSGD: bits per quantized value", "B"),
    SpecFlag("--cocktail-warmup", "plan.sync.cocktail.warmup_steps", "CocktailSGD: steps whose gradients are "
                                                                      "all-reduced first (see --cocktail-warmup-bits)",
             "N"),
    SpecFlag("--cocktail-warmup-bits", "plan.sync.cocktail.warmup_bits", "CocktailSGD: the warm-up's gradients "
                                                                           "quantized to 2, 4 or 8 bits with error "
                                                                           "feedback, or 32: uncompressed", "BITS"),
    SpecFlag("--diloco-h", "plan.sync.diloco.inner_steps", "DiLoCo: inner steps between outer steps", "H"),
    SpecFlag("--diloco-fragments", "plan.sync.diloco.fragments", "Streaming DiLoCo: fragments synchronized in turn",
             "N"),
    SpecFlag("--diloco-e3m0", "plan.sync.diloco.e3m0", "DiLoCo: 4-bit (E3M0) outer gradients"),
    SpecFlag("--diloco-overlap", "plan.sync.diloco.overlap_steps", "Streaming DiLoCo: inner steps trained while a "
                                                                   "fragment's outer gradient is on the wire "
                                                                   "(< H / fragments)", "TAU"),
    SpecFlag("--diloco-alpha", "plan.sync.diloco.merge_alpha", "after an outer step keep this share of the local "
                                                               "parameters (Streaming DiLoCo uses 0.5)", "ALPHA"),
)
PIPELINE_FLAGS = (
    SpecFlag("--wire-dtype", "plan.pipeline.wire_dtype", "activations and gradients between stages without "
                                                         "compression"),
    SpecFlag("--fwd-bits", "plan.pipeline.fwd_bits", "AQ-SGD: bits of forward activation deltas", "B"),
    SpecFlag("--bwd-bits", "plan.pipeline.bwd_bits", "AQ-SGD: bits of backward gradients", "B"),
    SpecFlag("--first-visit-bits", "plan.pipeline.first_visit_bits", "AQ-SGD: bits of a sample's first visit on a "
                                                                     "link, 16 = fp16", "B"),
    SpecFlag("--aq-buffer", "plan.pipeline.buffer", "AQ-SGD: where each link end keeps its buffer; disk: one file "
                                                    "per link end under $SHOAL_HOME/aq/RUN/, removed when the "
                                                    "node's links close"),
    SpecFlag("--aq-buffer-cap-mb", "plan.pipeline.buffer_cap_mb", "AQ-SGD: buffer cap per link end", "MB"),
    SpecFlag("--verify-stages", "plan.pipeline.verify_fraction", "verified pipeline stages: the fraction of each "
             "lane's micro-batches a replica of the same stage in another lane re-executes and compares (0.06 "
             "catches a stage tampering with 1 %% of its micro-batches within 1,000 steps at 99 %%); needs --sync "
             "allreduce, --pipeline-compression none and 2+ lanes (docs/verified-stages.md); 0: off", "FRACTION"),
    SpecFlag("--train-subset", "data.train_subset", "train on the first N samples only, epoch after epoch (0: all)",
             "N"),
)
SPEC_FLAGS = (NAME_FLAGS + MODEL_FLAGS + DATA_FLAGS + DATA_FIELD_FLAGS + OPTIM_FLAGS + PLAN_FLAGS + SYNC_FLAGS
              + PIPELINE_FLAGS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shoal.protocol.manifest import MODEL_SIZES, RunManifest

    sub = parser.add_subparsers(dest="run_command", metavar="ACTION", required=True)
    c = sub.add_parser("create", help="write a new signed manifest", description=CREATE_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("-o", "--output", required=True, metavar="PATH", help="where to write the manifest (TOML)")
    c.add_argument("--if-missing", action="store_true",
                   help="keep a manifest already at --output (verified) instead of writing a new one")
    add_spec_flags(c, RunManifest, NAME_FLAGS)
    c.add_argument("--identity", default=None, metavar="PATH",
                   help="Ed25519 key file that signs (created if missing; default: $SHOAL_HOME/identity.key)")
    m = c.add_argument_group("model and data")
    m.add_argument("--size", choices=MODEL_SIZES, default=field_default(spec_field(RunManifest, "model.size")),
                   help="built-in GPT preset (default: %(default)s)")
    m.add_argument("--model", metavar="hf:PATH",
                   help="a Hugging Face causal LM: a folder (config.json, *.safetensors, tokenizer.json) or a "
                        "config.json")
    m.add_argument("--arch", choices=("llama", "mistral", "qwen2", "qwen3", "gpt2"),
                   help="a Hugging Face architecture from scratch, sized by --layers/--d-model/--heads")
    m.add_argument("--kv-heads", type=int, metavar="N", help="--arch: key/value heads (default: --heads)")
    m.add_argument("--ffn", type=int, metavar="N", help="--arch: MLP width (default: the family's usual)")
    m.add_argument("--tokenizer", metavar="PATH",
                   help="a tokenizer.json (or a folder holding one); default: bytes, or the --model folder's")
    m.add_argument("--layers", type=int, metavar="N", help="override the preset's layer count")
    m.add_argument("--d-model", type=int, metavar="N", help="override the preset's width")
    m.add_argument("--heads", type=int, metavar="N", help="override the preset's head count")
    add_spec_flags(m, RunManifest, MODEL_FLAGS + DATA_FLAGS)
    m.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens per sequence (default: the preset's; 512 for a Hugging Face model, at most its "
                        "positions)")
    add_spec_flags(m, RunManifest, DATA_FIELD_FLAGS)
    o = c.add_argument_group("optimization")
    add_spec_flags(o, RunManifest, OPTIM_FLAGS[:1])
    o.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="sequences per optimizer step for the whole run, whatever its replicas: split across them "
                        "by their measured speed (default: --batch x --replicas)")
    o.add_argument("--micro-batch", type=int, metavar="N", help="sequences per micro-batch (default: --batch)")
    add_spec_flags(o, RunManifest, OPTIM_FLAGS[1:])
    p = c.add_argument_group("parallel plan and synchronization")
    add_spec_flags(p, RunManifest, PLAN_FLAGS)
    p.add_argument("--max-replicas", type=int, default=None, metavar="N",
                   help="volunteers who join later are seated as new replicas up to N (default: 4 x --replicas, at "
                        "least 8, at most what the global batch can share: every replica takes at least one "
                        "micro-batch with stages, one sequence without)")
    p.add_argument("--min-replicas", type=int, default=1, metavar="N",
                   help="with fewer replicas the run waits for more (default: %(default)s)")
    p.add_argument("--sync", choices=SYNC_METHODS,
                   help="how replicas stay together (default: cocktail; none when at most 1 replica)")
    add_spec_flags(p, RunManifest, SYNC_FLAGS)
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="micro-batches per step (default: 4 x stages with several stages, else one; "
                        "--micro-batch sets their size instead)")
    p.add_argument("--tie-embeddings", choices=("auto", "tied", "untied"), default="auto",
                   help="whether the head shares the embedding matrix (auto: tied with one stage, untied when split; "
                        "a split model must be untied; default: %(default)s)")
    p.add_argument("--pipeline-compression", choices=PIPELINE_COMPRESSION, default=None,
                   help="what crosses a stage boundary: none (activations at --wire-dtype) or aqsgd "
                        "(default: aqsgd with several stages)")
    add_spec_flags(p, RunManifest, PIPELINE_FLAGS)
    j = c.add_argument_group("who may join").add_mutually_exclusive_group()
    j.add_argument("--join-secret-file", metavar="PATH",
                   help="file holding the join secret; a new 256-bit secret is written there when the file does "
                        "not exist (the manifest stores nothing derived from it); nodes join with --secret")
    j.add_argument("--allow", action="append", metavar="PEER_ID", help="admit only these peers (repeat)")
    c.add_argument("--allow-weak-secret", action="store_true",
                   help="use the secret in --join-secret-file even if it looks easy to guess (fewer than 16 "
                        "characters or about 80 bits); the broker limits guesses, but a weak secret still falls")
    s = sub.add_parser("show", help="print a manifest and verify its signature",
                       description="Print a run manifest, its run id, and whether its signature is valid.")
    s.add_argument("path", metavar="RUN.toml", help="the manifest file")


def _secret_file(path: str, *, allow_weak: bool = False) -> str:
    """The join secret in `path`; a new high-entropy one written there (owner-only) when the file is missing. A
    secret the owner chose that looks easy to guess is refused (ValueError) unless `allow_weak`."""
    import os
    import sys

    from shoal.protocol.admission import new_secret, weak_secret

    try:
        with open(path, encoding="utf-8") as f:
            secret = f.read().strip()
    except FileNotFoundError:
        secret = new_secret()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secret + "\n")
    if not secret:
        raise ValueError(f"{path} holds no join secret")
    why = weak_secret(secret)
    if why is not None and not allow_weak:
        raise ValueError(f"the join secret in {path} is weak: {why}; anyone may try it online. Delete the file to "
                         f"have a 256-bit secret made there, or pass --allow-weak-secret to use it anyway")
    if why is not None:
        print(f"WARNING: the join secret in {path} is weak ({why}); guesses are rate-limited, but it can fall",
              file=sys.stderr)
    return secret


def build_manifest(args: argparse.Namespace):
    import functools
    import time

    from shoal.protocol import manifest as mf

    tie = {"auto": None, "tied": True, "untied": False}[args.tie_embeddings]
    from shoal.node.cli.hfmodel import model_and_tokenizer

    model, tokenizer, seq = model_and_tokenizer(args, tie)
    if args.micro_batch and args.micro_batches:
        raise ValueError("give --micro-batch (their size) or --micro-batches (their count), not both")
    micro_batches = args.micro_batches or (4 * args.stages if args.stages > 1 else 1)
    if not args.micro_batch and args.batch % micro_batches:
        raise ValueError(f"--batch {args.batch} does not split into {micro_batches} micro-batches")
    micro_batch = args.micro_batch or args.batch // micro_batches
    global_batch = args.global_batch or args.batch * args.replicas
    max_replicas = args.max_replicas if args.max_replicas is not None else mf.default_max_replicas(
        args.replicas, global_batch, mf.lane_granule(args.stages, micro_batch),
        cap=min(max(4 * args.replicas, 8), mf.MAX_LANES))
    sync_method = args.sync or ("none" if max_replicas == 1 else "cocktail")
    if args.join_secret_file:
        _secret_file(args.join_secret_file, allow_weak=args.allow_weak_secret)
        join = mf.JoinPolicy.private()
    elif args.allow:
        join = mf.JoinPolicy(mode="allowlist", allowlist=tuple(args.allow))
    else:
        join = mf.JoinPolicy()
    given = functools.partial(spec_values, args, SPEC_FLAGS)  # the manifest's fields set by flags, by record
    return mf.RunManifest(
        **given(""),
        created_at=int(time.time()),
        model=model,
        data=mf.DataSpec(**given("data"), tokenizer=tokenizer),
        plan=mf.ParallelPlan(
            **given("plan"),
            min_replicas=args.min_replicas,
            max_replicas=max_replicas,
            sync=mf.SyncSpec(method=sync_method, cocktail=mf.CocktailSpec(**given("plan.sync.cocktail")),
                             diloco=mf.DilocoSpec(**given("plan.sync.diloco"))),
            pipeline=mf.PipelineSpec(compression=args.pipeline_compression or ("aqsgd" if args.stages > 1 else "none"),
                                     **given("plan.pipeline")),
        ),
        optim=mf.OptimSpec(**{**given("optim"), "warmup_steps": min(args.warmup, args.steps)}),
        batch=mf.BatchSpec(batch_size=args.batch, micro_batch_size=micro_batch, seq_len=seq, global_batch=global_batch),
        eval=mf.EvalSpec(**given("eval")),
        checkpoint=mf.CheckpointSpec(**given("checkpoint")),
        join=join,
    )


def read_manifest(path: str):
    from shoal.protocol.manifest import RunManifest

    with open(path, encoding="utf-8") as f:
        return RunManifest.from_toml(f.read())


def main(args: argparse.Namespace) -> int:
    import os
    import sys

    from rich.console import Console

    from shoal.protocol.errors import ProtocolError, SignatureError

    console = Console(soft_wrap=True)
    if args.run_command == "create":
        from shoal.swarm.net.identity import load_or_create_identity

        if args.if_missing and os.path.exists(args.output):
            try:
                manifest = read_manifest(args.output)
                manifest.verify()
            except (OSError, ProtocolError) as e:
                print(f"shoal run create: {args.output} exists but is not a valid manifest: {e}", file=sys.stderr)
                return 2
            console.print(f"kept {args.output}\nrun id  {manifest.run_id}\nowner   {manifest.owner}")
            return 0

        from shoal.node.cli.datasource import typed_data

        args.data = typed_data(args.data)  # before anything is signed: a path that exists, stored absolute
        from shoal.node.train.datacheck import DataUnavailable
        from shoal.node.train.optional import MissingPackage

        try:
            manifest = build_manifest(args)
            if manifest.data.source.startswith("hf:"):  # the owner learns now that nodes could not read it
                from shoal.node.train.datacheck import check_source

                d = manifest.data
                check_source(d.source, hf_config=d.hf_config, hf_split=d.hf_split, text_field=d.text_field)
        except (DataUnavailable, MissingPackage) as e:
            print(f"shoal run create: {e}", file=sys.stderr)
            return 12
        except (ProtocolError, ValueError) as e:
            print(f"shoal run create: invalid manifest: {e}", file=sys.stderr)
            return 2
        from shoal.node.cli.node import shoal_home

        manifest = manifest.signed(load_or_create_identity(args.identity or shoal_home() / "identity.key"))
        from pathlib import Path

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{args.output}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(manifest.to_toml())
        os.replace(tmp, args.output)
        params = sum(manifest.stage_params(s) for s in range(manifest.plan.stages))
        console.print(f"wrote {args.output}\nrun id  {manifest.run_id}\nowner   {manifest.owner}\n"
                      f"model   {manifest.model.describe()}, {params / 1e6:.2f}M parameters")
        for digest, size in manifest.blobs():
            console.print(f"file    {digest[:16]}… ({'weights' if size else 'tokenizer'}), served to the run's nodes "
                          f"from {shoal_home() / 'blobs'}")
        return 0
    try:
        manifest = read_manifest(args.path)
    except (OSError, ProtocolError) as e:
        print(f"shoal run show: {args.path}: {e}", file=sys.stderr)
        return 2
    import tomli_w

    shown = manifest.to_wire()
    shown["signature"] = manifest.signature.hex()[:16] + "..." if manifest.signature else ""
    console.print(tomli_w.dumps(shown).rstrip(), markup=False, highlight=False)
    console.print(f"\nrun id     {manifest.run_id}")
    try:
        manifest.verify()
        console.print(f"signature  valid, by {manifest.owner}")
    except SignatureError as e:
        console.print(f"signature  INVALID: {e}")
        return 1
    return 0
