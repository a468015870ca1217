"""`shoal run create|show`: write a signed run manifest from flags, or print and verify one."""

from __future__ import annotations

import argparse

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
run's broker, and others join with the run id.

  shoal run create -o run.toml                               tiny GPT, stdlib corpus, 1 replica
  shoal run create --replicas 4 -o run.toml                  4 replicas with CocktailSGD
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="run_command", metavar="ACTION", required=True)
    c = sub.add_parser("create", help="write a new signed manifest", description=CREATE_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("-o", "--output", required=True, metavar="PATH", help="where to write the manifest (TOML)")
    c.add_argument("--if-missing", action="store_true",
                   help="keep a manifest already at --output (verified) instead of writing a new one")
    c.add_argument("--name", default="shoal-run", help="a name for people; not used by shoal (default: %(default)s)")
    c.add_argument("--identity", default=None, metavar="PATH",
                   help="Ed25519 key file that signs (created if missing; default: $SHOAL_HOME/identity.key)")
    m = c.add_argument_group("model and data")
    m.add_argument("--size", choices=("tiny", "small", "base"), default="tiny",
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
    m.add_argument("--positions", choices=("rope", "learned"), default="rope",
                   help="position encoding (default: %(default)s)")
    m.add_argument("--data", default="stdlib", metavar="SOURCE",
                   help="'stdlib', a .txt/.jsonl file or a folder of them, or hf:NAME (default: %(default)s)")
    m.add_argument("--seq-len", type=int, metavar="N",
                   help="tokens per sequence (default: the preset's; 512 for a Hugging Face model, at most its "
                        "positions)")
    m.add_argument("--text-field", default="text", metavar="NAME",
                   help="the column (jsonl key) that holds the text (default: %(default)s)")
    m.add_argument("--data-config", default="", metavar="NAME", help="hf: dataset configuration (subset)")
    m.add_argument("--data-split", default="train", metavar="NAME", help="hf: dataset split (default: %(default)s)")
    o = c.add_argument_group("optimization")
    o.add_argument("--batch", type=int, default=16, metavar="N",
                   help="sequences per optimizer step per replica (default: %(default)s)")
    o.add_argument("--micro-batch", type=int, metavar="N", help="sequences per micro-batch (default: --batch)")
    o.add_argument("--steps", type=int, default=2000, metavar="N",
                   help="total optimizer steps, the schedule's length (default: %(default)s)")
    o.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)g)")
    o.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="the inner (local) optimizer (default: %(default)s)")
    o.add_argument("--warmup", type=int, default=50, metavar="N",
                   help="learning-rate warm-up steps (default: %(default)s)")
    o.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: %(default)g)")
    o.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping (default: %(default)g)")
    o.add_argument("--seed", type=int, default=0, help="model initialization and data order (default: %(default)s)")
    o.add_argument("--eval-every", type=int, default=100, metavar="N",
                   help="held-out evaluation every N steps (default: %(default)s)")
    o.add_argument("--ckpt-every", type=int, default=100, metavar="N",
                   help="checkpoint every N steps (default: %(default)s)")
    o.add_argument("--keep", type=int, default=3, metavar="N", help="checkpoints to keep (default: %(default)s)")
    p = c.add_argument_group("parallel plan and synchronization")
    p.add_argument("--stages", type=int, default=1, metavar="S",
                   help="pipeline stages S: the model split into S consecutive pieces on different nodes "
                        "(default: %(default)s)")
    p.add_argument("--replicas", type=int, default=1, metavar="D",
                   help="data-parallel replicas D per stage (default: %(default)s)")
    p.add_argument("--sync", choices=("none", "allreduce", "cocktail", "diloco"),
                   help="how replicas stay together (default: none for D=1, else cocktail)")
    p.add_argument("--cocktail-p", type=float, default=0.1, metavar="P",
                   help="CocktailSGD: share of coordinates kept by the random mask (default: %(default)g)")
    p.add_argument("--cocktail-r", type=float, default=0.2, metavar="R",
                   help="CocktailSGD: share of those kept by top-k (default: %(default)g)")
    p.add_argument("--cocktail-bits", type=int, default=4, metavar="B",
                   help="CocktailSGD: bits per quantized value (default: %(default)s)")
    p.add_argument("--cocktail-warmup", type=int, default=100, metavar="N",
                   help="CocktailSGD: steps synchronized uncompressed first (default: %(default)s)")
    p.add_argument("--diloco-h", type=int, default=100, metavar="H",
                   help="DiLoCo: inner steps between outer steps (default: %(default)s)")
    p.add_argument("--diloco-fragments", type=int, default=1, metavar="N",
                   help="Streaming DiLoCo: fragments synchronized in turn (default: %(default)s)")
    p.add_argument("--diloco-e3m0", action="store_true", help="DiLoCo: 4-bit (E3M0) outer gradients")
    p.add_argument("--diloco-overlap", type=int, default=0, metavar="TAU",
                   help="Streaming DiLoCo: inner steps trained while a fragment's outer gradient is on the wire "
                        "(< H / fragments; default: %(default)s)")
    p.add_argument("--diloco-alpha", type=float, default=0.0, metavar="ALPHA",
                   help="after an outer step keep this share of the local parameters (Streaming DiLoCo uses 0.5; "
                        "default: %(default)g)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="micro-batches per step (default: 4 x stages with several stages, else one; "
                        "--micro-batch sets their size instead)")
    p.add_argument("--tie-embeddings", choices=("auto", "tied", "untied"), default="auto",
                   help="whether the head shares the embedding matrix (auto: tied with one stage, untied when split; "
                        "a split model must be untied; default: %(default)s)")
    p.add_argument("--pipeline-compression", choices=("none", "aqsgd"), default=None,
                   help="what crosses a stage boundary: none (activations at --wire-dtype) or aqsgd "
                        "(default: aqsgd with several stages)")
    p.add_argument("--wire-dtype", choices=("fp32", "fp16"), default="fp32",
                   help="activations and gradients between stages without compression (default: %(default)s)")
    p.add_argument("--fwd-bits", type=int, default=4, metavar="B",
                   help="AQ-SGD: bits of forward activation deltas (default: %(default)s)")
    p.add_argument("--bwd-bits", type=int, default=8, metavar="B",
                   help="AQ-SGD: bits of backward gradients (default: %(default)s)")
    p.add_argument("--first-visit-bits", type=int, default=8, metavar="B",
                   help="AQ-SGD: bits of a sample's first visit on a link, 16 = fp16 (default: %(default)s)")
    p.add_argument("--aq-buffer", choices=("memory", "disk"), default="memory",
                   help="AQ-SGD: where each link end keeps its buffer; disk: one file per link end under "
                        "$SHOAL_HOME/aq/RUN/, removed when the node's links close (default: %(default)s)")
    p.add_argument("--aq-buffer-cap-mb", type=int, default=4096, metavar="MB",
                   help="AQ-SGD: buffer cap per link end (default: %(default)s)")
    p.add_argument("--verify-stages", type=float, default=0.0, metavar="FRACTION",
                   help="verified pipeline stages: the fraction of each lane's micro-batches a replica of the same "
                        "stage in another lane re-executes and compares (0.06 catches a stage tampering with 1 %% of "
                        "its micro-batches within 1,000 steps at 99 %%); needs --sync allreduce, "
                        "--pipeline-compression none and 2+ lanes (docs/verified-stages.md) (default: off)")
    p.add_argument("--train-subset", type=int, default=0, metavar="N",
                   help="train on the first N samples only, epoch after epoch (default: all)")
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
    import time

    from shoal.protocol import manifest as mf

    tie = {"auto": None, "tied": True, "untied": False}[args.tie_embeddings]
    from shoal.node.cli.hfmodel import model_and_tokenizer

    model, tokenizer, seq = model_and_tokenizer(args, tie)
    sync_method = args.sync or ("none" if args.replicas == 1 else "cocktail")
    if args.micro_batch and args.micro_batches:
        raise ValueError("give --micro-batch (their size) or --micro-batches (their count), not both")
    micro_batches = args.micro_batches or (4 * args.stages if args.stages > 1 else 1)
    if not args.micro_batch and args.batch % micro_batches:
        raise ValueError(f"--batch {args.batch} does not split into {micro_batches} micro-batches")
    micro_batch = args.micro_batch or args.batch // micro_batches
    if args.join_secret_file:
        _secret_file(args.join_secret_file, allow_weak=args.allow_weak_secret)
        join = mf.JoinPolicy.private()
    elif args.allow:
        join = mf.JoinPolicy(mode="allowlist", allowlist=tuple(args.allow))
    else:
        join = mf.JoinPolicy()
    return mf.RunManifest(
        name=args.name,
        created_at=int(time.time()),
        seed=args.seed,
        model=model,
        data=mf.DataSpec(source=args.data, train_subset=args.train_subset, tokenizer=tokenizer,
                         hf_config=args.data_config, hf_split=args.data_split, text_field=args.text_field),
        plan=mf.ParallelPlan(
            stages=args.stages,
            replicas=args.replicas,
            sync=mf.SyncSpec(
                method=sync_method,
                cocktail=mf.CocktailSpec(p=args.cocktail_p, r=args.cocktail_r, bits=args.cocktail_bits, warmup_steps=args.cocktail_warmup),
                diloco=mf.DilocoSpec(inner_steps=args.diloco_h, fragments=args.diloco_fragments, e3m0=args.diloco_e3m0,
                                     overlap_steps=args.diloco_overlap, merge_alpha=args.diloco_alpha),
            ),
            pipeline=mf.PipelineSpec(compression=args.pipeline_compression or ("aqsgd" if args.stages > 1 else "none"),
                                     fwd_bits=args.fwd_bits, bwd_bits=args.bwd_bits, wire_dtype=args.wire_dtype,
                                     first_visit_bits=args.first_visit_bits, buffer=args.aq_buffer,
                                     buffer_cap_mb=args.aq_buffer_cap_mb, verify_fraction=args.verify_stages),
        ),
        optim=mf.OptimSpec(
            lr=args.lr, warmup_steps=min(args.warmup, args.steps), total_steps=args.steps,
            weight_decay=args.weight_decay, grad_clip=args.grad_clip, optimizer=args.optimizer,
        ),
        batch=mf.BatchSpec(batch_size=args.batch, micro_batch_size=micro_batch, seq_len=seq),
        eval=mf.EvalSpec(every_steps=args.eval_every),
        checkpoint=mf.CheckpointSpec(every_steps=args.ckpt_every, keep_last=args.keep),
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
        from shoal.node.train.hf import MissingPackage

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
