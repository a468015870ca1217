"""The benchmarks' settings: `shoal bench convergence`'s variants and refusals, `shoal bench network`'s workload
manifests, before any training."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.bench.convergence import BenchConfig, variants
from shoal.bench.workloads import workload


def test_each_cocktail_setting_is_a_variant_after_the_controls():
    labels = [v.label for v in variants(BenchConfig(cocktail=((0.1, 0.3, 4), (0.1, 0.2, 8))))]
    assert labels[0] == "allreduce fp32" and "control" in labels[1] and "control" in labels[2]
    assert labels[3:5] == ["cocktail p=0.1 r=0.3 b=4 (no warm-up)", "cocktail p=0.1 r=0.2 b=8 (no warm-up)"]
    cocktail = [v.sync.cocktail for v in variants(BenchConfig()) if v.label.startswith("cocktail")]
    assert [(c.p, c.r, c.bits) for c in cocktail] == [(0.1, 0.2, 4)]  # the defaults


def test_a_setting_the_manifest_refuses_is_refused_up_front():
    with pytest.raises(ValueError, match="'p'"):
        BenchConfig(cocktail=((2.0, 0.2, 4),))


@pytest.mark.parametrize("arg, message", [("0.1,x,4", "expected P,R,B"), ("0.1,0.2", "expected P,R,B"),
                                          ("0.1,0.2,4,5", "expected P,R,B"), ("2,0.2,4", "outside")])
def test_the_command_line_explains_a_bad_cocktail_setting(arg, message):
    out = subprocess.run([sys.executable, "-m", "shoal.node.cli", "bench", "convergence", "--cocktail", arg],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_pipeline_workload_takes_the_presets_width_with_more_layers():
    w = workload("pipeline-aqsgd")
    m = w.manifest(size="tiny", nodes=2, steps=60, lr=3e-3, eval_every=10, layers=4)
    default = w.manifest(size="tiny", nodes=2, steps=60, lr=3e-3, eval_every=10)
    assert (m.model.n_layers, m.model.d_model) == (4, default.model.d_model) and default.model.n_layers == 2
    assert m.plan.stages == 2 and m.plan.pipeline.compression == "aqsgd"
    assert m.batch.batch_size // m.batch.micro_batch_size == 8  # M = 4 x S micro-batches
    with pytest.raises(ValueError, match="1 layers do not split into 2 stages"):
        w.manifest(size="tiny", nodes=2, steps=60, lr=3e-3, eval_every=10, layers=1)
