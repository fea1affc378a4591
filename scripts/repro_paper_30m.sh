#!/usr/bin/env bash
# The paper's 30M loss-gap cell (SPEC §5, 25 tokens/param) on one GPU, and the same schemes at the
# largest budget that stays within one epoch of the corpus. Results: docs/results/paper_30m_h200/.
#
#   bash scripts/repro_paper_30m.sh CORPUS RESULTS
#
# CORPUS: a .jsonl/.txt/.parquet file or directory of them; `installed` to gather the source and
# documentation of this machine's Python (python -m data.installed_text: the GPU boxes here have no
# datasets and no network); or `c4` for the paper's exact data (C4 English streamed from the Hub,
# with TOKENIZER=/path/to/llama-2/tokenizer.model).
# RESULTS receives, as each run ends, its metrics.jsonl, summary.json and config.json, then the
# comparison report and the unbiasedness study; checkpoints stay under WORK.
#
# Environment (defaults in brackets):
#   RUNS      scheme:seed pairs, in order ["bf16:0 bf16:1 bf16:2 nvidia:0 four_over_six:0
#             tetrajet_v2:0 quartet2:0 quartet2:1 quartet2:2 nvidia:1 nvidia:2"]; a scheme may carry
#             ablation switches, quartet2+eden_correction=energy:0 (quant.eden_correction=energy)
#   BUDGETS   any of 25tpp (the paper's cell), epoch (one epoch of the train split) and
#             <N>tpp (N tokens per parameter) ["25tpp epoch"]
#   TOKENIZER a SentencePiece model; empty trains a 32,000-piece BPE on the corpus [empty]
#   WORK      checkpoints, data cache and logs [/tmp/paper_30m]
#   STUDY     1: the unbiasedness study on the first bf16 model trained, and compare_runs at the end [1]
#   Further arguments after RESULTS are passed to every train.py (e.g. wandb.enabled=false).
set -euo pipefail
CORPUS=${1:?corpus path, installed or c4}
RESULTS=${2:?results directory}
shift 2
RUNS=${RUNS:-"bf16:0 bf16:1 bf16:2 nvidia:0 four_over_six:0 tetrajet_v2:0 quartet2:0 quartet2:1 quartet2:2 nvidia:1 nvidia:2"}
BUDGETS=${BUDGETS:-"25tpp epoch"}
TOKENIZER=${TOKENIZER:-}
WORK=${WORK:-/tmp/paper_30m}
STUDY=${STUDY:-1}
mkdir -p "$RESULTS/runs" "$WORK"
RESULTS=$(cd "$RESULTS" && pwd)
export NFP4_DATA_CACHE=$WORK/cache PYTHONUNBUFFERED=1
python3 -c "import torch, triton, sentencepiece as s; print('torch', torch.__version__, 'triton', \
triton.__version__, 'sentencepiece', s.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" >"$RESULTS/versions.txt"
git rev-parse HEAD >>"$RESULTS/versions.txt" 2>/dev/null || true

data=(data.num_workers="$(nproc)")
[ -n "$TOKENIZER" ] && data+=(data.tokenizer_path="$TOKENIZER")
case "$CORPUS" in
    c4) data+=(data=c4) ;;
    installed)
        if [ ! -f "$WORK/installed.jsonl" ]; then
            python3 -m data.installed_text "$WORK/installed.jsonl" >"$RESULTS/corpus.json"
        fi
        data+=(data.inputs="[$WORK/installed.jsonl]" data.name=installed) ;;
    *) data+=(data.inputs="[$(realpath "$CORPUS")]") ;;
esac

# The dataset (and a trained tokenizer) once, before any run; its manifest gives the epoch budget.
python3 -m scripts.prepare_data experiment=paper_30m "${data[@]}" "$@" >"$RESULTS/dataset.json"
field() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))$1)" "$RESULTS/dataset.json"; }
train_tokens=$(field "['train']['tokens']")
dataset_dir=$(field "['dir']")
cp "$(field "['tokenizer']")" "$RESULTS/tokenizer.model"
epoch_steps=$((train_tokens / 262144))
echo "train split: $train_tokens tokens; one epoch: $epoch_steps steps of 262,144 tokens" | tee -a "$RESULTS/train_log.txt"

for budget in $BUDGETS; do
    case $budget in
        *tpp) steps=(train.tokens_per_param="${budget%tpp}") ;;
        epoch) steps=(train.tokens_per_param=null train.steps=$epoch_steps train.eval_every=$((epoch_steps / 10))) ;;
        *) echo "unknown budget $budget: use <N>tpp (25tpp is the paper's) or epoch" >&2; exit 2 ;;
    esac
    for run in $RUNS; do
        label=${run%%:*} seed=${run##*:}
        scheme=${label%%+*} switches=()
        IFS=+ read -ra parts <<<"${label#"$scheme"}"
        for sw in "${parts[@]}"; do
            if [ -n "$sw" ]; then switches+=(quant."$sw"); fi
        done
        log=$WORK/log-$label-s$seed-$budget.txt
        args=(experiment=paper_30m "${data[@]}" "${steps[@]}" quant="$scheme" "${switches[@]}" seed="$seed"
              run_root="$WORK/runs" "$@")
        if ! python3 train.py "${args[@]}" >>"$log" 2>&1; then
            tail -30 "$log"
            exit 1
        fi
        grep -E "^(run |done)" "$log" | tail -2 | tee -a "$RESULTS/train_log.txt"
        name=$(python3 train.py "${args[@]}" --cfg job --resolve | sed -n 's/^run_name: //p')
        mkdir -p "$RESULTS/runs/$name"
        cp "$WORK/runs/$name"/{metrics.jsonl,summary.json,config.json} "$RESULTS/runs/$name/"
        # The unbiasedness study on the first trained bf16 model's first block: checkpoints may not
        # outlive the machine, so it runs as soon as one exists.
        if [ "$STUDY" = 1 ] && [ "$scheme" = bf16 ] && [ ! -f "$RESULTS/unbiasedness/unbiasedness.json" ]; then
            python3 -m scripts.export_checkpoint "$WORK/runs/$name" "$WORK/$name.pt"
            python3 -m scripts.unbiasedness --model "$WORK/$name.pt" --device cuda --max-b 256 \
                --data "$dataset_dir" --batch 2 --seq-len 512 --out-dir "$RESULTS/unbiasedness" | tail -25
            echo "$name" >"$RESULTS/unbiasedness/model.txt"
        fi
    done
done

if [ "$STUDY" = 1 ]; then
    python3 -m scripts.compare_runs "$RESULTS/runs" --out "$RESULTS/report.md" --plot "$RESULTS/loss_gap.png" \
        --curves "$RESULTS/loss_gap_curves.png" --json "$RESULTS/report.json" | tail -30
fi
