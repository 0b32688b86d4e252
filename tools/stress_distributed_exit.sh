#!/usr/bin/env bash
# Exit-path stress: N consecutive 2-rank `portarl train` runs (2 steps, a checkpoint every
# step) under torchrun on the Gloo backend, while a CPU burner it starts itself keeps every
# core busy. Counts the runs whose torchrun exit status is not 0, and among them the
# exit-time aborts ("terminate called", SIGABRT), keeping each failing run's log.
#
#   tools/stress_distributed_exit.sh [RUNS] [OUT_DIR]     (defaults: 100, runs/stress-exit)
#   BURNERS=0 tools/stress_distributed_exit.sh 20          (no burner: the idle figure)
#   BURNERS=8 NICE=19 tools/stress_distributed_exit.sh     (harsher: 4 burners a core, ranks at
#                                                           the lowest priority, so a rank's
#                                                           threads lag its main thread at exit)
#   MODE=mechanism tools/stress_distributed_exit.sh 100    (the cause alone, a few seconds a run:
#                                                           tools/exit_race_worker.py, 2 Gloo ranks
#                                                           on DTensors, each run twice: the plain
#                                                           interpreter exit, then portarl's path)
#
# Every rank runs with PYTHONFAULTHANDLER=1, so an abort prints each Python thread's stack.
# The burner processes are killed on every exit path (normal end, error, Ctrl-C).
set -uo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-100}
OUT=${2:-runs/stress-exit}
BURNERS=${BURNERS:-$(nproc)}
NICE=${NICE:-0}
MODE=${MODE:-train}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! [[ "$RUNS" =~ ^[1-9][0-9]*$ ]]; then
  echo "stress_distributed_exit.sh: RUNS must be a positive integer, got '$RUNS'" >&2
  exit 2
fi
mkdir -p "$OUT"
burner_pids=()
stop_burners() {
  for pid in "${burner_pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${burner_pids[@]}"; do wait "$pid" 2>/dev/null; done
  burner_pids=()
}
trap stop_burners EXIT
trap 'stop_burners; exit 130' INT TERM
for _ in $(seq 1 "$BURNERS"); do
  "$PY" -c 'while True: pass' &
  burner_pids+=($!)
done
echo "stress ($MODE): $RUNS runs of 2 ranks under $BURNERS CPU burner(s), ranks at nice $NICE; logs of failures in $OUT"

SETS=(train.steps=2 checkpoint.every=1 train.prompts_per_step=4 train.sft_warmup_steps=0 train.micro_batch_size=4
      rollout.group_size=4 rollout.max_new_tokens=3 data.synthetic_size=64 model.hidden_size=32
      model.intermediate_size=64 logging.progress=false logging.plot=false)
args=()
for s in "${SETS[@]}"; do args+=(--set "$s"); done

failed=0 aborts=0 start=$(date +%s)
if [ "$MODE" = mechanism ]; then
  plain=0 ours=0
  for i in $(seq 1 "$RUNS"); do
    for how in plain portarl; do
      PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 nice -n "$NICE" "$PY" -m torch.distributed.run --nproc-per-node 2 \
        tools/exit_race_worker.py "$how" >"$OUT/last.log" 2>&1
      rc=$?
      if [ "$rc" -ne 0 ]; then
        cp "$OUT/last.log" "$OUT/failed-$how-$i.log"
        if [ "$how" = plain ]; then plain=$((plain + 1)); else ours=$((ours + 1)); fi
      fi
    done
    echo "run $i/$RUNS: failed so far: plain exit $plain, portarl's exit path $ours ($(( $(date +%s) - start )) s)"
  done
  echo "mechanism result: $RUNS runs each; plain interpreter exit failed $plain, portarl's exit path failed $ours ($BURNERS burner(s), nice $NICE, $(( $(date +%s) - start )) s)"
  [ "$ours" -eq 0 ]
  exit
elif [ "$MODE" != train ]; then
  echo "stress_distributed_exit.sh: MODE must be train or mechanism, got '$MODE'" >&2
  exit 2
fi
for i in $(seq 1 "$RUNS"); do
  run_dir="$OUT/run"
  log="$OUT/last.log"
  rm -rf "$run_dir"
  PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 nice -n "$NICE" "$PY" -m torch.distributed.run --nproc-per-node 2 -m portarl train \
    --device cpu --output-dir "$run_dir" "${args[@]}" >"$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    failed=$((failed + 1))
    if grep -q -e "terminate called" -e "SIGABRT" -e "Signal 6" "$log"; then aborts=$((aborts + 1)); fi
    cp "$log" "$OUT/failed-$i.log"
  fi
  echo "run $i/$RUNS: exit $rc (failed so far: $failed, of them exit-time aborts: $aborts; $(( $(date +%s) - start )) s)"
done
echo "stress result: $RUNS runs, $failed with a non-zero torchrun exit, $aborts of them exit-time aborts ($BURNERS burner(s), nice $NICE, $(( $(date +%s) - start )) s)"
[ "$failed" -eq 0 ]
