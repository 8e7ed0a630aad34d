#!/usr/bin/env bash
# The busy check (results/gpu/README.md, "The next check"): train_char.py's compiled training step
# at the two shapes of the GPU record, for MHA and both DAMCHA paths, in torch.compile's default
# and reduce-overhead (CUDA graphs) modes, with a profile of each step. One GPU, about 6 minutes:
# no row starts after 330 s, and the whole is stopped at 400 s with the rows it printed kept.
#
#     OUT=results-folder bash lab/gpu_busy.sh     # rows in $OUT/busy.jsonl, profiles in $OUT/busy/
#     OUT=/tmp/dry bash lab/gpu_busy.sh --smoke   # on a CPU: tiny shapes, checks that it runs
#
# Arguments after the script's are the check's own (lab/bench_triton_gpu.py --help) and win.
set -euo pipefail
out=$(realpath -m "${OUT:-gpu-busy}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
timeout 400 python lab/bench_triton_gpu.py --budget_check=0 --budget_op=0 --budget_model=0 \
    --budget_train=0 --budget_busy=320 --budget_total=330 --busy_shapes=shipped,wide \
    --compile_modes=default,reduce-overhead --busy_dir="$out/busy" "$@" \
    > "$out/busy.jsonl" 2> "$out/busy.stderr"
