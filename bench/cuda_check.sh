#!/usr/bin/env bash
# The standing CUDA check, in one call of at most 8 minutes: the train-step benchmark with every
# decode mode on a CUDA step (512 px JPEGs -> 256); the 4K sitting: photo-like 3840x2160 JPEGs
# -> 2048 decoded on the CPU (ours:process) against decode.device: cuda (the JPEG bytes to the
# trainer, decoded on its GPU), printing GPU decode ms per 4K image, host-to-device bytes per
# sample, step time and data-wait; then the training job (jobs/train.py --use-gpu) for a few
# minutes.
#
#   OUT=/tmp/cuda_check bash bench/cuda_check.sh [DEVICE] [SAMPLES] [JOB_STEPS]
#
# DEVICE defaults to cuda (cpu: a smoke run of this script without a GPU; the GPU decode part
# is then skipped). Writes under $OUT: train_step.json/.log (bench/train_step.py),
# fourk.json/.log (the 4K sitting), job.log (the [train] lines and the final summary),
# job_summary.txt (samples/s, step time and data-wait from that summary).
set -uo pipefail
DEVICE=${1:-cuda}
SAMPLES=${2:-4800}
JOB_STEPS=${3:-2500}
PY=${PY:-python3}
OUT=${OUT:-/tmp/cuda_check}
DATA=${DATA:-/tmp/ray_ingest_cuda_data}
CORES=$(nproc)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0

echo "== machine: $CORES cores, device $DEVICE"
if [ "$DEVICE" = cuda ]; then nvidia-smi -L || true; fi
$PY -c "import torch, ray; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
'ray', ray.__version__)" || exit 1

if [ -z "${SKIP_BENCH:-}" ]; then  # SKIP_BENCH=1: the job alone
echo "== train-step benchmark ($DEVICE step)"
timeout 150 $PY bench/train_step.py --device "$DEVICE" --data "$DATA" --samples "$SAMPLES" \
    --min-side 512 --max-side 512 --res 256 --batch 64 --epochs 3 --runs 3 \
    --cores $((CORES / 2)) --width 64 --depth 4 --torch-threads 4 --warmup-steps 10 \
    --only predecoded,ours:threads,ours:process,ours:actors,ours:tasks,wds_dl_pw \
    --json-out "$OUT/train_step.json" 2>&1 | grep -v "^      " | tee "$OUT/train_step.log"
fi

if [ -z "${SKIP_4K:-}" ]; then  # SKIP_4K=1: no 4K sitting
echo "== 4K: 3840x2160 photo-like JPEGs -> 2048, CPU decode vs decode.device: cuda ($DEVICE step)"
FOURK=ours:process,wds_dl_pw
if [ "$DEVICE" = cuda ]; then
  FOURK=ours:process,ours:decode.device=cuda+decode.compute=process,wds_dl_pw
fi
timeout 150 $PY bench/train_step.py --device "$DEVICE" --data "${DATA}_4k" --samples 96 \
    --shard-size 8 --min-side 3840 --max-side 3840 --aspect-ratios 16:9 --photo --res 2048 \
    --batch 8 --epochs 2 --runs 1 --cores $((CORES / 2)) --width 16 --depth 4 \
    --torch-threads 4 --warmup-steps 2 --only "$FOURK" \
    --json-out "$OUT/fourk.json" 2>&1 | grep -v "^      CPU" | tee "$OUT/fourk.log"
fi

echo "== jobs/train.py on $DEVICE, one rank, up to $JOB_STEPS steps"
cat > "$OUT/job.yaml" <<EOF
data: {paths: [$DATA], modalities: [image, caption], align: strict}
decode: {image_modality: image, caption_modality: caption, resolution: 256, crop: center,
         pool_min: 2, pool_max: $((CORES > 4 ? CORES / 2 : 2)), num_cpus: 1}
loader: {batch_size: 64, seed: 0, seed_mode: epoch, read_workers: 4, block_rows: 64}
train: {num_workers: 1, group_size: 1, cpus_per_worker: 1, epochs: 1000,
        checkpoint_every: 1000, log_every: 200, storage_path: /tmp/ray_ingest_cuda_runs,
        name: cuda_check, max_failures: 0}
EOF
GPU_FLAG=""
if [ "$DEVICE" = cuda ]; then GPU_FLAG=--use-gpu; fi
timeout 150 $PY jobs/train.py --config "$OUT/job.yaml" $GPU_FLAG --max-steps "$JOB_STEPS" \
    --num-cpus "$CORES" 2>&1 | tee "$OUT/job.log"
$PY - "$OUT/job.log" <<'EOF' | tee "$OUT/job_summary.txt"
import json, sys
done = [json.loads(l.split("[train] done: ", 1)[1]) for l in open(sys.argv[1])
        if "[train] done: " in l]
for d in done:
    steps = d["samples"] / 64
    print(f"rank {d['rank']}: {d['samples']} samples in {d['elapsed_s']:.1f} s = "
          f"{d['samples_per_s']:.0f} samples/s; step (compute) "
          f"{d['stages']['compute'] * d['elapsed_s'] / steps * 1e3:.2f} ms; data-wait "
          f"{d['data_wait_frac']:.1%} ({d['data_wait_s'] / steps * 1e3:.2f} ms per step); "
          f"stages {d['stages']}")
if not done:
    print("no final summary (the job did not finish)")
EOF
