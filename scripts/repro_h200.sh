#!/usr/bin/env bash
# A first, small reproduction of the paper's loss-gap comparison on one GPU (docs/results/).
#
#   STEPS=400 bash scripts/repro_h200.sh OUT_DIR
#   RUNS="bf16:0" COMPARE=0 bash scripts/repro_h200.sh OUT_DIR   # only the bf16 model + step 3's study
#
# Run from the repository root; the project need not be installed (the scripts run as modules).
#
# 1. Corpus: real text found on the machine (the Python sources of its site-packages; the GPU
#    boxes have no datasets and no network), written as jsonl, tokenized with a SentencePiece BPE
#    of 8192 pieces trained on it.
# 2. The 30m preset (30,482,560 non-embedding parameters) with an 8192 vocabulary, trained for the
#    same STEPS × 64 × 512 tokens under bf16 (seeds 0, 1, 2: the seed-to-seed spread), nvidia,
#    four_over_six, tetrajet_v2 and quartet2 (seed 0).
# 3. scripts/compare_runs.py: the loss-gap table and plots; scripts/unbiasedness.py on the trained
#    bf16 model's first block.
set -euo pipefail
OUT=${1:?output directory}
STEPS=${STEPS:-300}
RUNS=${RUNS:-"bf16:0 nvidia:0 four_over_six:0 tetrajet_v2:0 quartet2:0 bf16:1 bf16:2"}
COMPARE=${COMPARE:-1}
SITE=${SITE:-$(python3 -c 'import site; print(site.getsitepackages()[0])')}
WORK=${WORK:-/tmp/repro}
mkdir -p "$OUT" "$WORK"
export NFP4_DATA_CACHE=$WORK/cache PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

python3 - "$SITE" "$WORK/corpus.jsonl" <<'EOF'
import json, pathlib, sys
site, out = pathlib.Path(sys.argv[1]), sys.argv[2]
files = sorted(p for p in site.rglob("*.py") if p.is_file())
budget, n = 40_000_000, 0
with open(out, "w") as f:
    for p in files:
        text = p.read_text(errors="ignore")
        if len(text) < 200:
            continue
        f.write(json.dumps({"text": text}) + "\n")
        n += len(text)
        if n > budget:
            break
print(f"corpus: {n / 1e6:.0f} M characters of Python source from {site}")
EOF

common=(model=30m model.vocab_size=8192 "data.inputs=[$WORK/corpus.jsonl]" data.name=pysrc
        data.vocab_size=8192 data.val_fraction=0.03 data.num_workers=16 device=cuda precision=bf16
        wandb.enabled=false train.seq_len=512 train.batch_size=64 train.micro_batch_size=64
        train.steps=$STEPS train.log_every=50 train.eval_every=$((STEPS / 4)) train.eval_batches=8
        train.eval_batch_size=32 train.ckpt_every=$STEPS run_root=$WORK/runs)
for run in $RUNS; do
    set -- ${run/:/ }
    log=$WORK/log-$1-s$2.txt
    if ! python3 train.py "${common[@]}" quant=$1 seed=$2 >"$log" 2>&1; then
        tail -20 "$log"
        exit 1
    fi
    grep -E "^(run|step .*val|done)" "$log" | tee -a "$OUT/train_log.txt"
done

(cd "$WORK/runs" && tar czf "$OUT/runs.tgz" */metrics.jsonl */summary.json */train.log */.hydra/config.yaml)
if [ "$COMPARE" = 1 ]; then
    python3 -m scripts.compare_runs "$WORK/runs" --out "$OUT/report.md" --plot "$OUT/loss_gap.png" \
        --curves "$OUT/loss_gap_curves.png" | tail -30 || echo "compare_runs failed"
fi
ckpt=$(ls -d "$WORK"/runs/30m-bf16-*-s0/checkpoints/step_* | tail -1)
python3 -m scripts.export_checkpoint "$ckpt" "$WORK/bf16_model.pt"
python3 -m scripts.unbiasedness --model "$WORK/bf16_model.pt" --device cuda --max-b 256 \
    --data "$(dirname "$(ls "$NFP4_DATA_CACHE"/pysrc-*/manifest.json | head -1)")" --batch 2 --seq-len 512 --out-dir "$OUT/unbiasedness" | tail -25
