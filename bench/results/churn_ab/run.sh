#!/bin/bash
# A-B: the stop's starting tree (562ca90) vs the tree under test (this checkout), bench_churn's six overlapping
# faults with swarm up's default timeouts (--fail-after 8 --round-timeout 10), seeds alternating old/new.
# Run from the repository root: bash bench/results/churn_ab/run.sh   (SEEDS="1 2" STEPS=1000 by default)
set -u
R=$PWD
rm -rf /tmp/oldsrc /tmp/oldpkg; mkdir -p /tmp/oldsrc; git -C $R archive 562ca90 | tar -x -C /tmp/oldsrc
mkdir -p /tmp/oldpkg/shoal; for x in protocol kernels swarm node tui; do ln -sfn /tmp/oldsrc/$x /tmp/oldpkg/shoal/$x; done
ln -sfn /tmp/oldsrc/bench/lab /tmp/oldpkg/shoal/bench
for seed in ${SEEDS:-1 2}; do
  echo "== old seed $seed $(date +%T)"
  PYTHONPATH=/tmp/oldpkg timeout 900 python /tmp/oldsrc/bench/bench_churn.py --runs 1 --first-seed $seed --steps ${STEPS:-1000} --name churn_old --out /work/repro/churnres 2>&1 | tail -4
  echo "== new seed $seed $(date +%T)"
  timeout 900 python bench/bench_churn.py --runs 1 --first-seed $seed --steps ${STEPS:-1000} --name churn_new --out /work/repro/churnres 2>&1 | tail -4
done
echo "== end $(date +%T)"
