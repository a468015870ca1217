"""Thread/event-loop crossings per training step of a pipeline lane: runs `shoal bench pipeline ARGS...` in this
process with `trio.to_thread.run_sync` and `trio.from_thread.run` counted, and prints, per lane run (compression),
the calls into worker threads and into the loop made while training, per step and per micro-batch.

    python bench/crossings.py OUT.json --stages 2 --compression aqsgd,none --wire fp32 --train-subset 64 ...

A call is two crossings (there and back). The bench's own calls (each stage's trainer thread, once per phase) and
the final evaluation are not counted. Works on any shoal tree that has `shoal bench pipeline` (the lab moved from
shoal.node.experiments to shoal.bench), so the same script measures the code before and after a change.
"""

from __future__ import annotations

import collections
import importlib
import json
import sys
import threading

import trio

counts: collections.Counter = collections.Counter()
state = {"evaluating": 0}
lock = threading.Lock()
_to_thread, _from_thread = trio.to_thread.run_sync, trio.from_thread.run


def _name(fn) -> str:
    fn = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


async def counted_to_thread(fn, *args, **kw):
    name = _name(fn)
    if not state["evaluating"] and not name.endswith((".train", ".evaluate")):
        with lock:
            counts["to_thread " + name] += 1
    return await _to_thread(fn, *args, **kw)


def counted_from_thread(fn, *args, **kw):
    if not state["evaluating"]:
        with lock:
            counts["from_thread " + _name(fn)] += 1
    return _from_thread(fn, *args, **kw)


def main() -> int:
    out_path, argv = sys.argv[1], sys.argv[2:]
    trio.to_thread.run_sync, trio.from_thread.run = counted_to_thread, counted_from_thread
    from shoal.node.train.trainer import Trainer

    evaluate = Trainer.evaluate

    def counted_evaluate(self):
        state["evaluating"] += 1
        try:
            return evaluate(self)
        finally:
            state["evaluating"] -= 1

    Trainer.evaluate = counted_evaluate
    try:
        bench = importlib.import_module("shoal.bench.pipeline_bench")
    except ImportError:
        bench = importlib.import_module("shoal.node.experiments.pipeline_bench")
    runs = []
    run_lane = bench.run_lane

    async def counted_run_lane(m, corpus, steps, **kw):
        counts.clear()
        result = await run_lane(m, corpus, steps, **kw)
        micro = m.batch.batch_size // m.batch.micro_batch_size
        calls = dict(sorted(counts.items()))
        total = sum(calls.values())
        runs.append({"stages": m.plan.stages, "compression": m.plan.pipeline.compression,
                     "wire": m.plan.pipeline.wire_dtype, "steps": steps, "micro_batches": micro,
                     "calls": calls, "calls_per_step": round(total / steps, 2),
                     "crossings_per_step": round(2 * total / steps, 2),
                     "crossings_per_micro_batch": round(2 * total / steps / micro, 2),
                     "tokens_per_s": result.get("tokens_per_s")})
        return result

    bench.run_lane = counted_run_lane
    from shoal.node.cli import main as shoal

    try:
        code = shoal(["bench", "pipeline", *argv])
    except SystemExit as e:
        code = e.code
    with open(out_path, "w") as f:
        json.dump({"argv": argv, "exit": code, "runs": runs}, f, indent=1)
    for r in runs:
        print(f"S={r['stages']} {r['compression']}/{r['wire']}: {r['crossings_per_step']} crossings per step "
              f"({r['crossings_per_micro_batch']} per micro-batch), {r['tokens_per_s']} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
