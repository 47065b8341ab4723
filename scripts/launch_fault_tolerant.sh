#!/usr/bin/env bash
# Fault-tolerant training with torchft on one machine: a lighthouse, then one torchrun per replica group, each
# restarted alone (--max-restarts) when one of its processes dies; Hydra overrides pass through.
#
#   scripts/launch_fault_tolerant.sh 2 trainer.max_steps=2000 model=mlp data=classification
#   STRATEGY=hybrid NPROC=2 scripts/launch_fault_tolerant.sh 2 strategy.pipeline_parallel_size=2   # pp2 groups
#   STRATEGY=hybrid NPROC=4 MAX_RESTARTS=10 scripts/launch_fault_tolerant.sh 4 strategy.pipeline_parallel_size=2 \
#       strategy.tensor_parallel_size=2 trainer.accelerator=gpu                                      # pp2 x tp2 groups
#
# Settings (environment): STRATEGY [ddp: one rank per group; hybrid / pipeline / tensor: one whole model of
# NPROC = pp x tp ranks per group], NPROC ranks per replica group [1], MAX_RESTARTS per group [3], MIN_REPLICAS
# [1], LIGHTHOUSE_PORT [29510], BASE_PORT [29600] (group g's rendezvous listens on BASE_PORT + g), OUT [outputs/ft].
# Each group uses torchrun's c10d rendezvous and its own worker store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so
# that a restarted group of several ranks reconnects (torch issue 135712).
# Across machines run the lighthouse once (`torchft_lighthouse --min_replicas 1 --bind [::]:29510`) and on each
# machine the torchrun line below with its own REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE=http://<that host>:29510.
set -euo pipefail
groups=${1:?usage: $0 NUM_REPLICA_GROUPS [hydra overrides...]}
shift
nproc=${NPROC:-1}
strategy=${STRATEGY:-ddp}
port=${LIGHTHOUSE_PORT:-29510}
base=${BASE_PORT:-29600}
min=${MIN_REPLICAS:-1}
out=${OUT:-outputs/ft}

torchft_lighthouse --min_replicas "$min" --join_timeout_ms 10000 --bind "[::]:$port" &
lighthouse=$!
trap 'kill "$lighthouse" 2>/dev/null || true' EXIT

pids=()
for ((g = 0; g < groups; g++)); do
    REPLICA_GROUP_ID=$g NUM_REPLICA_GROUPS=$groups TORCHFT_LIGHTHOUSE=http://localhost:$port \
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
        torchrun --nnodes 1 --nproc-per-node "$nproc" --max-restarts "${MAX_RESTARTS:-3}" \
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$((base + g)) \
        -m lightning_par.train strategy="$strategy" strategy.fault_tolerance=torchft strategy.min_replicas="$min" \
        trainer.devices="$nproc" hydra.run.dir="$out/replica-$g" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
