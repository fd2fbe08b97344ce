#!/bin/sh
# The planned paper runs (docs/planner.md "The paper's runs"); run from the repository root:
#   sh bench/results/planned/run.sh   (writes the JSON next to this script)
set -e
D=bench/results/planned
PLAN="${PYTHON:-.venv/bin/python} -m longstraw.cli plan"
RC="--recompute-layers on"  # the pre-issue-36 default at these pieces (auto now recomputes only where it must)
Q="--model qwen3.6-27b --prompt-tokens 2088960 --group 8 --response-tokens 8192 --gpus 8 --lora-rank 16 --weight-dtype nf4"
for mode in detached exact; do
  # exact: the GDN snapshots (73 GiB on every rank) in host memory; the walk stays divided
  X=""; [ $mode = exact ] && X="--offload-snapshots on"
  for pieces in 2048 8192; do
    $PLAN $Q $RC --branch-chunk-size $pieces --mode $mode $X --json > $D/qwen36_27b_8xh20_p${pieces}_${mode}.json
  done
  $PLAN $RC --model qwen3.6-27b --prompt-tokens 2097152 --group 8 --response-tokens 8192 --gpus 1 --lora-rank 16 \
    --gpu-memory 141GB --offload-state --branch-chunk-size 2048 --mode $mode --json \
    > $D/qwen36_27b_1xh200_offload_${mode}.json
done
$PLAN $RC --model glm-5.2 --prompt-tokens 2088960 --group 8 --response-tokens 8192 --gpus 32 --branch-chunk-size 1024 \
  --lora-rank 8 --offload-state --shard-params --json > $D/glm52_32xh20_p1024_offload.json
# the same with expert parallelism: each rank holds 8 of the 256 experts per layer, never gathered whole
$PLAN $RC --model glm-5.2 --prompt-tokens 2088960 --group 8 --response-tokens 8192 --gpus 32 --branch-chunk-size 1024 \
  --lora-rank 8 --offload-state --shard-params --expert-parallel --json > $D/glm52_32xh20_p1024_offload_ep.json
# issue 36: the same three paper runs given only the paper's settings, --fit on an H20 preset with 15% of
# 96 GiB held back (--reserve 14.4GiB: the fit is <= 85% of 96 GiB); the flags it prints plan the same peak
F="--gpu h20 --reserve 14.4GiB --fit --json"
$PLAN $Q --mode detached $F > $D/fit_qwen36_27b_8xh20_detached.json
$PLAN $Q --mode exact $F > $D/fit_qwen36_27b_8xh20_exact.json
$PLAN --model glm-5.2 --prompt-tokens 2088960 --group 8 --response-tokens 8192 --gpus 32 --lora-rank 8 $F \
  > $D/fit_glm52_32xh20.json
