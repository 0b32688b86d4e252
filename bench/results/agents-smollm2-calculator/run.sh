#!/bin/bash
# SmolLM2 calculator example: async (hf), vllm colocated, vllm async; each evaluated as docs/agents.md does.
cd /work/main
SFT=/tmp/w37b/sft/sft-model
run() {  # name venv sets...
  name=$1; venv=$2; shift 2
  echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  /usr/bin/time -f "$name wall %e s" env VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 1500 $venv/bin/portarl train --config examples/smollm2-calculator.yaml \
     --set model.path=$SFT --output-dir /tmp/calc/$name --overwrite --set logging.progress=false "$@" > /tmp/calc/$name.log 2>&1
  echo "$name rc=$? end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"; tail -2 /tmp/calc/$name.log
  timeout 900 .venv/bin/python examples/eval_calculator.py --model /tmp/calc/$name/checkpoints/step-000008 > /tmp/calc/$name.eval 2>&1
  echo "$name eval rc=$?"; tail -4 /tmp/calc/$name.eval
}
run async .venv --set rollout.mode=async
run vllm .venv-vllm --set rollout.engine=vllm
run vllm-async .venv-vllm --set rollout.engine=vllm --set rollout.mode=async
