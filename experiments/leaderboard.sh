#!/usr/bin/env bash
# The policy leaderboard (conf/experiment/leaderboard.yaml) for one model, task sizes for 2 CPU cores:
#   bash experiments/leaderboard.sh smollm2-135m           # -> experiments/results/leaderboard_smollm2-135m/
#   bash experiments/leaderboard.sh gemma3-270m quality    # only the quality sweeps (timing-free: any load)
#   bash experiments/leaderboard.sh gemma3-270m throughput # only KV bytes + tok/s at batch 16 (quiet cores)
# Four sweeps into one study folder (multirun/leaderboard_<model>): agreement with the full cache, WikiText-2
# perplexity, RULER, and a batch of 16 Azure code-trace requests (KV bytes held, tokens/s). Finished jobs are
# skipped on a rerun (skip_existing), so an interrupted leaderboard resumes where it stopped.
# Sizes can be changed through the environment (AGREEMENT, PERPLEXITY, RULER: extra overrides per sweep).
# REPEATS=3 runs the throughput sweep three times (the repeats with seed=1, 2: other run folders); the
# report gives each cell the median of its runs.
# Each sweep runs the `full` reference once (it ignores the ratio), then the other policies x 4 ratios.
set -uo pipefail
MODEL=${1:-smollm2-135m}
PHASE=${2:-all}
PY=${PY:-.venv/bin/python}
STUDY=leaderboard_${MODEL}
COMMON="experiment=leaderboard model=${MODEL} name=${STUDY}"
AGREEMENT=${AGREEMENT:-"task.prompt_length=512 task.num_prompts=4"}
PERPLEXITY=${PERPLEXITY:-"task.context_lengths=[512] task.num_windows=8"}
RULER=${RULER:-"task.lengths=[1024] task.num_samples=2"}
REPEATS=${REPEATS:-1}

sweep() {  # one sweep: the full reference, then every other policy at every ratio
    $PY -m kvlab -m $COMMON "$@" policy=full policy.compression_ratio=0 || status=1
    $PY -m kvlab -m $COMMON "$@" || status=1
}

status=0  # a failed job fails its sweep (exit 1) after the sweep's other jobs ran; the table shows what finished
if [ "$PHASE" != throughput ]; then
    sweep task=agreement $AGREEMENT workload=none
    sweep task=perplexity $PERPLEXITY workload=none
    sweep task=ruler $RULER workload=none
fi
if [ "$PHASE" != quality ]; then
    sweep task=none
    for ((k = 1; k < REPEATS; k++)); do sweep task=none seed=$k; done
fi
$PY -m kvlab.study.report multirun/${STUDY} --out experiments/results/leaderboard_${MODEL} || status=1
exit $status
