#!/usr/bin/env bash
# enn_cluster's one-GPU device check (under 8 min on one H100/H200), from the repo root:
#   OUT=DIR bash bench/device_check.sh          (on the device tool $OUT is set)
# The paths no CPU test reaches in their GPU form: placement on real PCI/NUMA sysfs, the
# fabric and memlock checks, the NCCL lane, fused AdamW's found_inf skip on FSDP2 DTensors,
# torch.compile with the composable activation checkpoint (bench/device_micro.py); then
# `enn-submit` itself: bf16 training of a model saved in bf16 (fp32 masters and Adam moments
# in the checkpoint), async DCP saves + verify + resume, bf16 predict with generation, LoRA
# (fp32 adapters, no frozen tensor saved), float8 training (real float8 matmuls on an H100/H200),
# doctor, and bench/gpu.py's tokens/s and MFU.
# One PASS/FAIL/INFO line per check in $OUT/summary.txt; everything in $OUT/log.txt.
# DC_GPUS=0 DC_SMALL=1 DC_COMPILE=false runs the same flow on the CPU
# (tests/repo/test_gpu_check_script.py). Env: PY (python3), DC_GPUS (1), DC_COMPILE (true),
# DC_SMALL (tiny shapes), DC_BENCH (1: bench/gpu.py --quick on a GPU).
set -u
OUT=${OUT:-/tmp/enn-device-check}; mkdir -p "$OUT"
PY=${PY:-python3}; GPUS=${DC_GPUS:-1}; COMPILE=${DC_COMPILE:-true}
export DC_GPUS="$GPUS" DC_COMPILE="$COMPILE" DC_SMALL="${DC_SMALL:-}"
SEQ=512; MB=8; [ -z "$DC_SMALL" ] || { SEQ=64; MB=2; }
W=$(mktemp -d "${TMPDIR:-/tmp}/enn-dc.XXXXXX")
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
LOG="$OUT/log.txt"; SUM="$OUT/summary.txt"; : > "$LOG"; : > "$SUM"
T0=$SECONDS
say() { echo "$*" | tee -a "$SUM"; }
step() {  # step NAME TIMEOUT_S CMD...: PASS/FAIL on the command's exit code
  local name=$1 t=$2 s=$SECONDS rc; shift 2
  echo "=== $name: $*" >> "$LOG"
  timeout "$t" "$@" >> "$LOG" 2>&1; rc=$?
  if [ $rc -eq 0 ]; then say "PASS $name ($((SECONDS - s)) s)"; else say "FAIL $name rc=$rc ($((SECONDS - s)) s; see log.txt)"; fi
  return $rc
}
lines() {  # lines NAME TIMEOUT_S CMD...: the command prints its own PASS/FAIL/INFO lines
  local name=$1 t=$2 rc; shift 2
  echo "=== $name: $*" >> "$LOG"
  timeout "$t" "$@" > "$W/$name.out" 2>> "$LOG"; rc=$?
  cat "$W/$name.out" >> "$LOG"; grep -E '^(PASS|FAIL|INFO) ' "$W/$name.out" | tee -a "$SUM"
  [ $rc -eq 0 ] || say "FAIL $name rc=$rc (see log.txt)"
}
CLI=("$PY" -m enn_cluster.client.cli)

# 0. facts
{ if [ "$GPUS" -gt 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  echo "ulimit -l: $(ulimit -l)  nproc: $(nproc)  /dev/shm: $(df -h /dev/shm | awk 'NR==2{print $2}')"
  "$PY" -c "import torch,sys;c=torch.cuda.is_available();print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'nccl',torch.cuda.nccl.version() if c else None,'bf16',c and torch.cuda.is_bf16_supported())"
} 2>&1 | sed 's/^/INFO /' | tee -a "$SUM"

# 1. every worker module imports under this torch (the image build's own gate)
step import_check 120 "$PY" -m enn_cluster.worker.import_check

# 2. in-process checks: placement, fabric/memlock, lane, fused AdamW skip, compile + AC
OUT="$OUT" lines micro 240 "$PY" -m bench.device_micro

# 3. bench/gpu.py: tokens/s and MFU of enn-submit train on a ~1B Llama, the figure this check exists for
if [ "${DC_BENCH:-1}" = 1 ] && [ "$GPUS" -gt 0 ] && [ $((SECONDS - T0)) -lt 200 ]; then
  step bench_gpu 210 "$PY" -m bench.run --only gpu --quick --out "$W/bench" --workdir "$W/benchwork"
  grep -h -i -E "gpu|mfu|tokens" "$W"/bench/results*.md 2>/dev/null | head -4 | sed 's/^/INFO bench: /' | tee -a "$SUM"
  cp "$W"/bench/results.md "$W"/bench/results.json "$OUT"/ 2>/dev/null
else
  say "INFO bench_gpu skipped (elapsed $((SECONDS - T0)) s)"
fi

# 4. a ~60M Llama saved in bf16 (as real checkpoints are), its vocabulary well past 256
step assets 120 "$PY" -m bench.device_micro assets "$W"
cat > "$W/cfg.yaml" <<EOF
run_name: dc
runs_root: $W/runs
model: {name: "hf:$W/model"}
data: {train_path: $W/train.parquet, eval_path: $W/eval.parquet, text_field: text, max_length: $SEQ, packing: true}
training: {max_steps: 12, per_device_train_batch_size: $MB, lr: 0.0003, warmup_ratio: 0.1, bf16: auto, compile: $COMPILE}
checkpoint: {every_steps: 4, keep_last: 2, async_save: auto}
logging: {every_steps: 4}
parallel: {strategy: fsdp, nodes: 1, procs_per_node: 1, activation_checkpointing: selective}
EOF
RUN="$W/runs/dc"
SHAPE=(--nodes 1 --gpus-per-node "$GPUS"); [ "$GPUS" -gt 0 ] || SHAPE+=(--procs-per-node 1)

# 5. full fine-tune: bf16 + compile + selective AC + async DCP saves, then verify and inspect
step train_full 240 "${CLI[@]}" train --config "$W/cfg.yaml" "${SHAPE[@]}"
step verify 60 "${CLI[@]}" verify "$RUN"
lines inspect 60 "$PY" -m bench.device_micro inspect "$RUN"

# 6. resume from the async checkpoint (DCP load + the compile again), 4 more steps
step resume 180 "${CLI[@]}" resume "$RUN" "${SHAPE[@]}" --set training.max_steps=16
if grep -q '"kind": "resume"' "$RUN/metrics.jsonl"; then say "PASS resume_record"; else say "FAIL resume_record"; fi

# 7. predict (a bf16 replica) with generation, then collect
step predict_generate 150 "${CLI[@]}" predict "$RUN" --input "$W/prompts.jsonl" --name gen --generate 4 "${SHAPE[@]}"
step collect 60 "${CLI[@]}" collect "$RUN" --name gen --out "$W/gen.npy"
"$PY" -c "import numpy as np,sys;a=np.load(sys.argv[1]);print(('PASS' if a.shape[0]==16 and np.isfinite(a[:,0]).all() else 'FAIL')+' predict_output shape',a.shape)" "$W/gen.npy" 2>>"$LOG" | tee -a "$SUM"
step doctor 90 "${CLI[@]}" doctor "$RUN"
grep -E "^(kernels|precision|distributed)" "$LOG" | tail -3 | sed 's/^/INFO doctor: /' | tee -a "$SUM"

# 8. LoRA, no compile, 6 steps: the adapters and their moments fp32, no frozen tensor saved
step train_lora 150 "${CLI[@]}" train --config "$W/cfg.yaml" "${SHAPE[@]}" --set run_name=dcl --set lora.r=8 \
  --set training.compile=false --set training.max_steps=6 --set checkpoint.every_steps=3
lines inspect_lora 60 "$PY" -m bench.device_micro inspect "$W/runs/dcl" lora

# 9. float8 full fine-tune, no compile, 4 steps: float8 matmuls on an H100/H200 (emulated on
# the CPU), the weights all-gathered in float8, the checkpoint fp32 as without it
step train_float8 150 "${CLI[@]}" train --config "$W/cfg.yaml" "${SHAPE[@]}" --set run_name=dcf \
  --set training.float8=true --set training.compile=false --set training.max_steps=4
WANT=on; [ "$GPUS" -gt 0 ] || WANT=emulated
"$PY" -c "import json,glob,sys;r=json.load(open(glob.glob(sys.argv[1]+'/logs/*/backend-rank-0.json')[0]));print(('PASS' if r.get('float8')==sys.argv[2] else 'FAIL')+' float8_report',r.get('float8'),'want',sys.argv[2])" "$W/runs/dcf" "$WANT" 2>>"$LOG" | tee -a "$SUM"
lines inspect_float8 60 "$PY" -m bench.device_micro inspect "$W/runs/dcf" float8

cp "$RUN/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
say "DONE in $((SECONDS - T0)) s: $(grep -c '^PASS' "$SUM") PASS, $(grep -c '^FAIL' "$SUM") FAIL"
