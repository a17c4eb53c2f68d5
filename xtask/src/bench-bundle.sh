#!/usr/bin/env bash
# The benchmark suite on the GPU machine: primitive costs, then tq-bench with its anchors (the C
# socket floor and PyTorch's torch.multiprocessing queues) in the same run. The table of ratios is
# printed last; bench.json, latency.png and throughput.png go to $OUT (or ./results). Arguments
# are passed on to tq-bench (for example `--only rtt,stream`). `--only cross` runs the cross-device
# table alone (2 GPUs; with its anchors, bench/cross_anchors.py among them) and skips the primitive
# costs and the MPS run; `--only cross-stages` runs where one cross-GPU message's time goes
# (PeerCopy and PeerMap, 4 KiB and 1 MiB, beside the hand-off floor; seconds). `--only hosts` runs the across-hosts table alone (tq-hosts; host tensors
# over TCP against a plain TCP stream included). `--only host-msgs` runs issue 26's 1,000,000 small
# host messages alone (no GPU needed). BENCHMARKS.md lists which command prints each row of issue 26.
set -u
here=$(cd "$(dirname "$0")" && pwd)
results=${OUT:-$here/results}
mkdir -p "$results"
export IPC_TESTS_BIN_DIR="$here/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
only=""
prev=""
for arg in "$@"; do
  [ "$prev" = "--only" ] && only=$arg
  prev=$arg
done
if [ "$only" = "hosts" ]; then
  # The across-hosts table (TCP + NCCL, default and network transports) against
  # torch.distributed NCCL send/recv with the same settings (cross_anchors.py's NCCL parts).
  "$here/bin/tq-hosts" --out "$results" --anchors "$here/bench/cross_anchors.py" --python "${PYTHON:-python3}" \
    | tee "$results/hosts-table.md"
  exit "${PIPESTATUS[0]}"
fi
# A section of its own (cross, cross-stages, host-msgs) skips the primitive costs and the MPS run.
alone=""
case "$only" in cross|cross-stages|host-msgs) alone=1 ;; esac
primitives=()
if [ -z "$alone" ]; then
  echo "[0] CUDA IPC primitive costs" >&2
  "$here/bin/primitive-costs" 2>&1 | tee "$results/primitive-costs.txt"
  primitives=(--primitives "$results/primitive-costs.txt")
fi
# Streaming again under MPS (kernels of both processes share the GPU without time-slicing), with a
# private MPS daemon that is stopped afterwards; NO_MPS=1 skips it.
mps=()
if [ -z "${NO_MPS:-}" ] && [ -z "$alone" ] && command -v nvidia-cuda-mps-control > /dev/null; then
  echo "[mps] streaming under a private MPS daemon" >&2
  mkdir -p "$results/mps"
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
  if timeout 30 nvidia-cuda-mps-control -d; then
    timeout 300 "$here/bin/tq-bench" --out "$results/mps" --only stream --capacity 4 --in-flight 2 \
      > "$results/mps/table.md" < /dev/null && mps=(--mps "$results/mps/bench.json")
    echo quit | timeout 30 nvidia-cuda-mps-control
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
"$here/bin/tq-bench" "${mps[@]}" "${primitives[@]}" --out "$results" --floor "$here/bin/socket-floor" \
  --torch "$here/bench/torch_anchor.py" --cross-anchors "$here/bench/cross_anchors.py" --python "${PYTHON:-python3}" \
  "$@" | tee "$results/table.md"
exit "${PIPESTATUS[0]}"
