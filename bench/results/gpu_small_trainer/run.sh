#!/bin/bash
# issue 28's small GPU case: this tree's trainer vs the previous commit's (.old/), each against its own bare loop, one machine
set -u
R=$PWD
mkpkg(){ mkdir -p $1/shoal; for x in protocol kernels swarm node tui; do ln -sfn $2/$x $1/shoal/$x; done; ln -sfn $2/bench/lab $1/shoal/bench; }
rm -rf /tmp/oldsrc /tmp/newpkg /tmp/oldpkg; mkdir /tmp/oldsrc
cp -r $R/protocol $R/kernels $R/swarm $R/node $R/tui $R/bench /tmp/oldsrc/
cp .old/trainer.py /tmp/oldsrc/node/train/trainer.py; cp .old/batch.py /tmp/oldsrc/node/train/batch.py
mkpkg /tmp/newpkg $R; mkpkg /tmp/oldpkg /tmp/oldsrc
nvidia-smi --query-gpu=name,driver_version --format=csv 2>/dev/null; python -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
B=${B:-"--models llama --sizes small --steps 150 --warmup 5 --rounds 6"}
DEV=${DEV:-cuda}
run(){ echo "== $1 $(date +%T)"; PYTHONPATH=/tmp/$2pkg:${PYTHONPATH:-} timeout ${T:-170} python /tmp/oldsrc/bench/gpu_checks/stub_libp2p.py bench/bench_gpu_train.py $B --device $DEV --out $OUT --name $1 2>&1 | grep -v Warning | tail -${TL:-12}; }
run small_new new; run small_old old
B="--models gpt --sizes small --steps 200 --warmup 5" run gpt_small_new new
run small_new2 new
echo "== end $(date +%T)"
