#!/usr/bin/env bash
# The benchmark suite on the GPU machine: primitive costs, then tq-bench with its anchors (the C
# socket floor and PyTorch's torch.multiprocessing queues) in the same run. The table of ratios is
# printed last; JSON goes to $OUT (or ./results) as bench.json.
set -u
here=$(cd "$(dirname "$0")" && pwd)
results=${OUT:-$here/results}
mkdir -p "$results"
export IPC_TESTS_BIN_DIR="$here/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
"$here/bin/primitive-costs" > "$results/primitive-costs.txt" 2>&1
"$here/bin/tq-bench" --json "$results/bench.json" --floor "$here/bin/socket-floor" \
  --torch "$here/bench/torch_anchor.py" --python "${PYTHON:-python3}"
rc=$?
echo
cat "$results/primitive-costs.txt"
exit $rc
