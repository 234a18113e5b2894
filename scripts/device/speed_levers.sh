#!/usr/bin/env bash
# The speed levers of SD3.5-Medium's Flow-GRPO loop on the lent H200, one at a time on top of the compiled
# baseline, then the best combination: SD3.5-M at its real size (random weights built in code into
# runs/sd35m-random, as bench_sd35m.sh builds it), the published settings (`--recipe sd3-grpo`: 512², 10 steps,
# CFG 4.5, LoRA r32, SDE on 9 steps, micro-batches of 8 pairs). Carry `.whl`. The configurations and what is
# read from them are in benchmarks/speed_levers.py (`flags`, `table`).
#
# JOBS: items run in order (default "train1"):
#   train:NAME   `diffrl bench-train --recipe sd3-grpo --compile` + NAME's flags, reward jpeg_compressibility in
#                REWARD_WORKERS (2) worker processes, ROLLOUTS (2) rollouts of PROMPT_GROUPS (1) prompt × 16 samples
#                (the recipe's: 4; the rollout is cut so that a compiled run takes ~1.5-3 min: the first rollout
#                and its training pay the compilation, the second is the steady state the table reports)
#                into runs/speed-levers/train-NAME/
#   engine:NAME  benchmarks/family_rollout.py --family sd3 --resolution 512 --guidance-scale 4.5 --n 16
#                --ms ENGINE_MS (8 16) --compile + NAME's flags: the transformer, the decode, the engine on a group
#                of 16; diffusers' StableDiffusion3Pipeline in engine:base only (a lever changes the transformer
#                the pipeline shares), into runs/speed-levers/engine-NAME.json
#   NAME: base (--compile alone), autotune (max-autotune-no-cudagraphs: long compile), flash,
#         cudnn, efficient, fuse-qkv, vae-all (--vae-decode-batch 0), mb16, mb32-gc, no-eager-numerics (train),
#         vae-4 (engine), float8 (--float8: FP8 matmuls; its drift: benchmarks/float8_drift.py), and combo: the levers measured so far under runs/speed-levers that beat base by 2%
#         (train: without doubling the first pass's |Δ log p|), the best of each exclusive group
#   sdpa         which SDPA kernel torch picks here for SD3.5-M's attention, and which ones can run it
#   table        the tables from everything under runs/speed-levers (also printed at the end of every call)
#   train1 = "sdpa train:base train:cudnn"
#   train2 = "train:flash train:fuse-qkv train:mb16 train:combo"
#   (vae-all is left to the engine job: a training rollout of 16 images decodes in 2 calls either way)
#   engine = "engine:base engine:cudnn engine:fuse-qkv engine:vae-all engine:combo"
#   fp8 = "train:base train:float8" (the engine alone, plain against FP8 in one run: benchmarks/float8_drift.py)
# BUDGET_S (570): a run is given only the time left until this many seconds after the script began (then it
# is stopped and shows "timed out"), so that a call ends within its 600 s with the table printed.
# TRAIN_FLAGS / ENGINE_FLAGS: more flags for every run of that kind (they come last, so they win).
# A dry run of the plumbing on a CPU: WHEELS=0 (no wheels to install) CKPT=a tiny sd3 checkpoint DIR=elsewhere,
# TRAIN_FLAGS="--resolution 32 --device cpu" ENGINE_FLAGS="--resolution 32 --dtype float32 --device cpu".
#
# One matrix does not fit one 600 s call. Measured on an H200 (2026-12-02, one warm machine, carry [".whl"]): the
# checkpoint builds in 24 s; train1 took 339 s (base 200 s with its compilation, cudnn 90 s), train2 413 s (flash,
# fuse-qkv, mb16, combo 80-140 s each), engine 420 s (base with the pipeline ~130 s, each lever 60-80 s): ~20 min of
# device time with the start. runs/ and the compile cache stay on the machine while it is warm, so train:combo in
# the second call sees the first call's results (on a fresh machine it finds none and runs base's flags):
#   JOBS=train1 bash scripts/device/speed_levers.sh
#   JOBS=train2 bash scripts/device/speed_levers.sh
#   JOBS=engine bash scripts/device/speed_levers.sh
# Results: $OUT/speed_levers.md (the tables) and $OUT/results.tgz (speed-levers/: each run's metrics.jsonl and
# config.json, the engine JSONs, flags, exit statuses, log tails; packed: a call brings back 8 files);
# `python benchmarks/speed_levers.py table --dir DIR` rebuilds the tables from the copies of several calls put in
# one folder.
set -uo pipefail
started=$(date +%s)
[[ ${WHEELS:-1} == 0 ]] || bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
ckpt=${CKPT:-$PWD/runs/sd35m-random}  # runs/ is git-ignored: kept on a warm machine between calls
dir=${DIR:-runs/speed-levers}
mkdir -p "$dir" "$OUT/speed-levers"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|^train \|torchvision\|^ *$\|Writing model" ; }
make_ckpt() {
  [[ -d $ckpt ]] || (cd benchmarks && python3 -c "
import sys, torch; from pathlib import Path; from family_rollout import make_checkpoint
make_checkpoint('sd3', Path(sys.argv[1]), torch.device('cuda'))" "$ckpt")
}
left() { echo $(( started + ${BUDGET_S:-570} - $(date +%s) )); }
groups=${PROMPT_GROUPS:-1}
jobs=()
for job in ${JOBS:-train1}; do
  case $job in
    train1) jobs+=(sdpa train:base train:cudnn) ;;
    train2) jobs+=(train:flash train:fuse-qkv train:mb16 train:combo) ;;
    engine) jobs+=(engine:base engine:cudnn engine:fuse-qkv engine:vae-all engine:combo) ;;
    fp8) jobs+=(train:base train:float8) ;;
    *) jobs+=("$job") ;;
  esac
done
for job in "${jobs[@]}"; do
  kind=${job%%:*}; name=${job#*:}
  echo "== $job $(date +%T), $(left) s left"
  case $kind in
    sdpa)
      python3 benchmarks/speed_levers.py sdpa | tee "$OUT/speed-levers/sdpa.json" ;;
    table) ;;
    train|engine)
      make_ckpt
      if (( $(left) < 30 )); then echo "skipped: the budget is spent"; continue; fi
      mapfile -t flags < <(python3 benchmarks/speed_levers.py flags "$kind" "$name" --dir "$dir")
      echo "flags: --compile ${flags[*]}"
      printf '%s\n' "${flags[@]}" > "$dir/$kind-$name.flags"; cp "$dir/$kind-$name.flags" "$OUT/speed-levers/"
      log=$OUT/speed-levers/$kind-$name.log
      if [[ $kind == train ]]; then
        run=$dir/train-$name; rm -rf "$run" "$run.rc"
        # shellcheck disable=SC2086  # TRAIN_FLAGS is a list of words
        timeout -k 10 "$(left)" python3 -m diffrl.cli.main bench-train --recipe sd3-grpo --model-path "$ckpt" \
          --diffusion-model-family sd3 --num-rollout "${ROLLOUTS:-2}" --rollout-batch-size "$groups" \
          --global-batch-size $(( 16 * groups )) --reward jpeg_compressibility --reward-workers "${REWARD_WORKERS:-2}" \
          --output-dir "$run" --compile "${flags[@]}" ${TRAIN_FLAGS:-} > "$log.full" 2>&1
        echo $? > "$run.rc"
        mkdir -p "$OUT/speed-levers/train-$name"
        cp "$run/metrics.jsonl" "$run/config.json" "$OUT/speed-levers/train-$name/" 2>/dev/null
        cp "$run.rc" "$OUT/speed-levers/"
      else
        out=$(cd "$dir" && pwd)/engine-$name.json; rm -f "$out" "${out%.json}.rc"
        # shellcheck disable=SC2086  # ENGINE_MS and ENGINE_FLAGS are lists of words
        (cd benchmarks && timeout -k 10 "$(left)" python3 family_rollout.py --family sd3 --checkpoint "$ckpt" \
          --resolution 512 --guidance-scale 4.5 --n 16 --ms ${ENGINE_MS:-8 16} --repeats 2 --compile "${flags[@]}" \
          ${ENGINE_FLAGS:-} --out "$out") > "$log.full" 2>&1
        echo $? > "${out%.json}.rc"
        cp "$out" "${out%.json}.rc" "$OUT/speed-levers/" 2>/dev/null
      fi
      quiet < "$log.full" | grep -v '^ \|^[{}]' | tail -40 > "$log"; rm -f "$log.full"
      tail -14 "$log"
      echo "exit status $(cat "$dir/$kind-$name.rc")" ;;
    *) echo "unknown job $job (train:NAME, engine:NAME, sdpa, table, train1, train2, engine)" ;;
  esac
done
python3 benchmarks/speed_levers.py table --dir "$dir" --out "$OUT/speed_levers.md"
echo "== done $(date +%T), $(( $(date +%s) - started )) s"
bash scripts/device/pack_out.sh
