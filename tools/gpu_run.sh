#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md ("GPU: first measurements"), on random weights of the
# Qwen pair's shapes (the packaged GGUF files do not travel to a lent GPU machine). Run from the
# repository root on a CUDA machine where torch and the project's dependencies import:
#     OUT=gpu_out bash tools/gpu_run.sh [step ...]
# Steps (default: all, in this order): kernels profile bench agreement profile-compiled
# bench-compiled agreement-compiled. Each has its own time limit, so one slow compile cannot take
# the others with it; OUT (default ./gpu_out) receives the JSON reports.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
AT="python3 -m autotune.cli.main"
PAIR="--model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --device cuda --random-weights"
BENCH="bench $PAIR --dtype auto --limit 3 --prompt-len 128 --max-new-tokens 128"
step() { local limit=$1; shift; echo "=== $* ($(date +%T))"; timeout "$limit" "$@"; echo "=== rc $? ($(date +%T))"; }
run() {
    case $1 in
        kernels) step 40 python3 tools/gpu_checks.py kernels ;;
        profile) step 100 $AT profile $PAIR --widths 1,2,4,8,16,32,64 --lp-size 2,4 --json "$OUT/profile_eager.json" ;;
        bench) step 120 $AT $BENCH --methods hf,hf-static,vanilla,sd,lookup --json "$OUT/bench_eager.json" ;;
        agreement) step 80 python3 tools/gpu_checks.py agreement --model qwen2.5-coder-0.5b --tokens 64 ;;
        profile-compiled) step 120 $AT profile $PAIR --compile --widths 1,8 --lp-size 4 --json "$OUT/profile_compiled.json" ;;
        bench-compiled) step 180 $AT $BENCH --methods vanilla,sd,lookup --compile --json "$OUT/bench_compiled.json" ;;
        agreement-compiled) step 150 python3 tools/gpu_checks.py agreement --model qwen2.5-coder-0.5b --tokens 64 \
            --compile --dtypes bfloat16 ;;
        *) echo "unknown step $1" >&2; return 2 ;;
    esac
}
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
for s in "${@:-kernels profile bench agreement profile-compiled bench-compiled agreement-compiled}"; do
    for one in $s; do run "$one"; done
done
