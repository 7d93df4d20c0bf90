#!/usr/bin/env bash
# The leaderboard through lm-evaluation-harness (conf/experiment/lm_eval_leaderboard.yaml) for one model:
#   bash experiments/lm_eval_leaderboard.sh smollm2-135m        # -> experiments/results/lm_eval_leaderboard_smollm2-135m/
#   POLICIES=snapkv,streaming_llm RATIOS=0.5 LIMIT=20 bash experiments/lm_eval_leaderboard.sh gemma3-270m   # a smaller grid
# The `full` reference once, then POLICIES x RATIOS (default: six policies x 0.25/0.5/0.75, as the experiment's
# sweep) on TASKS (default: the experiment's), LIMIT documents per task; finished jobs are skipped on a rerun.
# METADATA=key=value[,key=value] sets the tasks' data parameters (lm-eval task metadata), e.g. METADATA=num_samples=1 gives
# kvlab_ruler one sample per subtask (LIMIT would take the first subtask's samples only). Each TASKS / LIMIT /
# METADATA value is a job set of its own (they are part of a job's config hash); kvlab-report merges their
# columns per (policy, ratio).
# THROUGHPUT=1 adds the KV MiB held and tokens/s columns: the policy leaderboard's workload-only sweep (a batch
# of 16 Azure code-trace requests, conf/experiment/leaderboard.yaml) into the same study, merged by kvlab-report
# per (policy, ratio). Timing: run it on quiet cores.
# THREADS=n sets torch's intra-op threads (OMP_NUM_THREADS) of every job: on cores shared with other jobs, THREADS=1
# avoids the two threads of each small op waiting on each other (3.8x faster on a 576-wide layer at load 12 on two
# cores). LOGGER=none skips the W&B offline run of every job (its start took 26 s under that load; the local record
# that kvlab-report reads is always written).
set -uo pipefail
[ -n "${THREADS:-}" ] && export OMP_NUM_THREADS=${THREADS}
MODEL=${1:-smollm2-135m}
PY=${PY:-.venv/bin/python}
STUDY=lm_eval_leaderboard_${MODEL}
GRID=("policy=${POLICIES:-snapkv,pyramidkv,streaming_llm,tova,knorm,expected_attention}"
      "policy.compression_ratio=${RATIOS:-0.25,0.5,0.75}")
SIZES=()
[ -n "${LIMIT:-}" ] && SIZES+=("task.limit=${LIMIT}")
[ -n "${TASKS:-}" ] && SIZES+=("task.tasks=${TASKS}")
M=${METADATA:-}; for kv in ${M//,/ }; do SIZES+=("+task.metadata.${kv}"); done
[ -n "${LOGGER:-}" ] && SIZES+=("logger=${LOGGER}")
COMMON=(experiment=lm_eval_leaderboard "model=${MODEL}" "name=${STUDY}" "${SIZES[@]}")
status=0
$PY -m kvlab -m "${COMMON[@]}" policy=full policy.compression_ratio=0 || status=1
$PY -m kvlab -m "${COMMON[@]}" "${GRID[@]}" || status=1
if [ "${THROUGHPUT:-0}" = 1 ]; then
    TIMING=(experiment=leaderboard "model=${MODEL}" "name=${STUDY}" task=none)
    $PY -m kvlab -m "${TIMING[@]}" policy=full policy.compression_ratio=0 || status=1
    $PY -m kvlab -m "${TIMING[@]}" "${GRID[@]}" || status=1
fi
$PY -m kvlab.study.report "multirun/${STUDY}" --out "experiments/results/lm_eval_leaderboard_${MODEL}" || status=1
exit $status
