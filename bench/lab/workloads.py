"""What the network benchmark trains: one manifest per synchronizer (or pipeline plan), and its payload formula.

A workload is data: the run's parallel plan and synchronizer settings, the rest of the manifest shared by all
(model size, batch, optimizer, evaluation), so every workload of a run trains the same model on the same data.
Pipeline runs are workloads with `stages=2` and a `pipeline` spec (fp32 activations, or AQ-SGD).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.protocol import manifest as mf

TINY_EVAL_BATCHES = 8
PIPELINE_SUBSET = 256  # the pipeline workloads train on 256 samples, epoch after epoch (fine-tuning's regime)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    name: str
    sync: mf.SyncSpec
    stages: int = 1
    pipeline: mf.PipelineSpec = field(default_factory=mf.PipelineSpec)
    description: str = ""
    train_subset: int = 0  # samples trained on epoch after epoch (0: all); AQ-SGD's deltas need samples to return

    def __post_init__(self) -> None:
        if not self.name or self.stages < 1:
            raise ValueError("a workload needs a name and at least one stage")

    def replicas(self, nodes: int) -> int:
        if nodes % self.stages:
            raise ValueError(f"{self.name}: {nodes} nodes do not split into {self.stages} stages")
        return nodes // self.stages

    def manifest(self, *, size: str, nodes: int, steps: int, lr: float, eval_every: int, seed: int = 0,
                 warmup_steps: int = 10, layers: int | None = None) -> mf.RunManifest:
        """The run: `nodes` nodes, all of them active (S stages x D replicas), no backups; a pipeline splits each
        step into M = 4 x S micro-batches (docs/pipeline.md, "Schedule"). `layers`: the preset's width with this many
        layers instead of its own."""
        extra = {}
        if layers is not None:
            if layers < self.stages:
                raise ValueError(f"{self.name}: {layers} layers do not split into {self.stages} stages")
            extra["model"] = mf.ModelSpec.preset(size, n_layers=layers)
        if self.stages > 1:
            b = mf.RunManifest.default(size).batch
            extra["batch"] = mf.BatchSpec(batch_size=b.batch_size, micro_batch_size=max(
                1, b.batch_size // (4 * self.stages)), seq_len=b.seq_len)
        return mf.RunManifest.default(
            size, name=f"bench network {self.name}", seed=seed, **extra,
            plan=mf.ParallelPlan(stages=self.stages, replicas=self.replicas(nodes), sync=self.sync,
                                 pipeline=self.pipeline),
            optim=mf.OptimSpec(lr=lr, total_steps=max(steps, warmup_steps + 1), warmup_steps=warmup_steps),
            eval=mf.EvalSpec(every_steps=eval_every, batches=TINY_EVAL_BATCHES),
            data=mf.DataSpec(train_subset=self.train_subset))

    def payload_formula(self, numel: int, nodes: int) -> float | None:
        """Synchronizer bytes one node sends per step in steady state (tensor payloads, frame headers excluded),
        for `numel` parameters; None where no formula is known (pipelines: activations depend on the schedule)."""
        if self.stages > 1:
            return None
        d = self.replicas(nodes)
        if d < 2:
            return 0.0
        chunk = -(-numel // d)  # every member owns about N/D coordinates: sends D-1 chunks, broadcasts its own D-1 times
        s = self.sync
        if s.method == "allreduce":
            return 2 * (d - 1) * chunk * {"fp32": 4, "fp16": 2, "bf16": 2}[s.allreduce.dtype]
        if s.method == "cocktail":
            from shoal.kernels.cocktail import CocktailConfig

            c = CocktailConfig(p=s.cocktail.p, r=s.cocktail.r, bits=s.cocktail.bits)
            return 2 * (d - 1) * c.payload_nbytes(chunk)
        if s.method == "diloco":
            from shoal.kernels.codec import E3M0Codec

            per_elem = E3M0Codec().payload_nbytes(chunk) if s.diloco.e3m0 else 4 * chunk
            return 2 * (d - 1) * per_elem / s.diloco.inner_steps  # every parameter once per H steps
        return None


def _sync(method: str, **kw) -> mf.SyncSpec:
    return mf.SyncSpec(method=method, **kw)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(name="allreduce", sync=_sync("allreduce"), description="fp32 gradients, reduce-scatter + all-gather"),
    Workload(name="allreduce-fp16", sync=_sync("allreduce", allreduce=mf.AllReduceSpec(dtype="fp16")),
             description="fp16 gradients"),
    Workload(name="cocktail", sync=_sync("cocktail", cocktail=mf.CocktailSpec(warmup_steps=10)),
             description="CocktailSGD p=0.1 r=0.2 b=4, 10 warm-up steps of fp32 all-reduce"),
    Workload(name="diloco-e3m0", sync=_sync("diloco", diloco=mf.DilocoSpec(inner_steps=20, e3m0=True)),
             description="DiLoCo H=20, E3M0 4-bit outer gradients"),
    Workload(name="streaming-diloco", sync=_sync("diloco", diloco=mf.DilocoSpec(
        inner_steps=20, e3m0=True, fragments=2, overlap_steps=5, merge_alpha=0.5)),
             description="Streaming DiLoCo H=20, 2 fragments, tau=5, alpha=0.5, E3M0"),
    Workload(name="pipeline-fp32", sync=_sync("allreduce"), stages=2, pipeline=mf.PipelineSpec(compression="none"),
             train_subset=PIPELINE_SUBSET, description="S=2 pipeline, fp32 activations and gradients"),
    Workload(name="pipeline-aqsgd", sync=_sync("allreduce"), stages=2, pipeline=mf.PipelineSpec(compression="aqsgd"),
             train_subset=PIPELINE_SUBSET,
             description="S=2 pipeline, AQ-SGD activation deltas (4-bit forward, 8-bit backward, first visits 8-bit)"),
)}
ALIASES = {"allreduce-fp32": "allreduce", "fp32": "allreduce", "fp16": "allreduce-fp16", "diloco": "diloco-e3m0",
           "streaming": "streaming-diloco", "pipeline": "pipeline-aqsgd"}


def workload(name: str) -> Workload:
    w = WORKLOADS.get(ALIASES.get(name, name))
    if w is None:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    return w
