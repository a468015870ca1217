#!/bin/bash
# `shoal node` on a GPU machine, end to end: --device auto resolves to CUDA, the memory estimate against what
# training allocates (per preset), `train --device cuda:N` past the last device, and a two-node run of the `small`
# model joined by run id, with the volunteer's terminal captured (`script`). Writes $OUT/summary.txt, memory.json,
# owner.txt, volunteer_screen.txt and logs.tgz. Needs shoal importable by $PY (default python3); with
# SHOAL_SITE=DIR, DIR is put on PYTHONPATH and the wheels in DIR/../whl are installed first (how it ran on a
# machine without shoal's dependencies: see bench/results/gpu_node_check.md).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "${SHOAL_SITE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$SHOAL_SITE"/../whl/*.whl || exit 1
  export PYTHONPATH=$SHOAL_SITE:/tmp/site
fi
export PYTHONUNBUFFERED=1 SHOAL_HOME=/tmp/shoal-home
PY=${PY:-python3}
S="$PY -m shoal.node.cli"
W=/tmp/w17; rm -rf $W; mkdir -p $W; cd $W
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee -a $OUT/summary.txt
$PY - <<'PY' 2>&1 | tee -a $OUT/summary.txt
import torch
from shoal.node.train.device import resolve_device, free_memory_bytes, device_name
d = resolve_device("auto")
print("torch", torch.__version__, "auto ->", d, device_name(d), "free", free_memory_bytes(d))
try:
    resolve_device(f"cuda:{torch.cuda.device_count()}")
except Exception as e:
    print("cuda:N past the last device ->", type(e).__name__, e)
PY
# the memory estimate against what training really allocates, per preset (3 steps each)
$PY - <<'PY' 2>&1 | tee -a $OUT/summary.txt
import json, torch, time
from shoal.protocol.manifest import RunManifest
from shoal.node.train.trainer import Trainer
from shoal.node.train.memory import stage_memory
rows = []
for size in ("tiny", "small", "base"):
    m = RunManifest.default(size)
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    t = Trainer(m, device="cuda")
    t0 = time.perf_counter()
    for _ in range(3):
        r = t.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    est = stage_memory(m, half=True)
    rows.append({"size": size, "params": est.params, "estimate_bytes": est.total_bytes, "peak_allocated_bytes": peak,
                 "estimate_over_peak": round(est.total_bytes / peak, 3), "tokens_per_s_3_steps": round(r.tokens_per_s)})
    print(rows[-1])
    del t
json.dump(rows, open("/tmp/memory.json", "w"), indent=1)
PY
cp /tmp/memory.json $OUT/ 2>/dev/null
# the CLI: train --device auto, and a named device that is not there
timeout 120 $S train --size tiny --steps 20 --no-progress --out $W/t 2>&1 | tail -3 | tee -a $OUT/summary.txt
$S train --device cuda:7 --steps 1 --out $W/t2 > /dev/null 2>> $OUT/summary.txt; echo "exit $?" >> $OUT/summary.txt
# a two-node run on this GPU, --device auto (the default): the owner, then a volunteer joining by run id
$S run create --size ${SIZE:-small} --replicas 2 --steps 60 --sync cocktail --cocktail-warmup 10 --eval-every 20 -o $W/run.toml > $W/create.txt
RUN=$(awk '/run id/{print $3}' $W/create.txt)
$S node --listen /ip4/127.0.0.1/tcp/0 --run $W/run.toml --address-file $W/owner.addrs --print-every 2 > $OUT/owner.txt 2>&1 &
OWNER=$!
for i in $(seq 60); do [ -s $W/owner.addrs ] && break; sleep 1; done
VOL="$S node --join @$W/owner.addrs --run $RUN --print-every 2 --status-file $W/vol.json"
if command -v script >/dev/null; then
  script -qfec "$VOL" $OUT/volunteer_screen.txt > /dev/null &
else
  $VOL > $OUT/volunteer_screen.txt 2>&1 &
fi
WRAP=$!
for i in $(seq 200); do grep -q '"state": "done"' $W/vol.json 2>/dev/null && break; sleep 1; done
sleep 3
echo "GPU memory of the two nodes (CUDA context and cache included), training done:" >> $OUT/summary.txt
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> $OUT/summary.txt 2>&1
kill -INT $($PY -c "import json; print(json.load(open('$W/vol.json'))['pid'])"); wait $WRAP
echo "volunteer exit $?" >> $OUT/volunteer_screen.txt
kill -INT $OWNER; wait $OWNER; echo "owner exit $?" >> $OUT/owner.txt
tar czf $OUT/logs.tgz -C $SHOAL_HOME logs; ls $OUT
