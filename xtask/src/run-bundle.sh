#!/usr/bin/env bash
# Runs every GPU test, example and benchmark of this bundle; prints a pass/fail summary last.
# Usage: run.sh [PATTERN]: only the steps whose name contains PATTERN. Each step has STEP_TIMEOUT
# seconds (default 240). Full logs go to ./logs, and as one archive to $OUT (the device tool's
# output folder) when set; $OUT/progress.log grows as steps finish, so a cut-off run still tells.
set -u
only=${1:-}
limit=${STEP_TIMEOUT:-240}
here=$(cd "$(dirname "$0")" && pwd)
logs=$here/logs
rm -rf "$logs"
mkdir -p "$logs"
export IPC_TESTS_BIN_DIR="$here/bin" TQ_BIN="$here/bin/tq"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
summary=()
failed=0

progress=${OUT:-$logs}/progress.log
step() { # step NAME COMMAND...
  local name=$1; shift
  case "$name" in *"$only"*) ;; *) return ;; esac
  local log="$logs/$name.log"
  local start=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  { echo "== $name: exit $rc after $((SECONDS - start))s"; tail -25 "$log"; } >> "$progress"
  local verdict=PASS
  [ $rc -eq 0 ] || { verdict="FAIL (exit $rc)"; failed=$((failed + 1)); }
  local extra
  extra=$(grep -E '^test result:|ignored, |^(FAILED|SKIPPED|ERROR) |^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* =+$' "$log" | sed 's/^/    /' | head -20)
  summary+=("$(printf '%-40s %-14s %3ss' "$name" "$verdict" $((SECONDS - start)))")
  [ -n "$extra" ] && summary+=("$extra")
  [ $rc -eq 0 ] || tail -30 "$log"
}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$logs/gpus.txt" 2>&1
# GPU tests run one at a time (they measure device memory and compete for the GPU); the host-only
# binaries, which CI runs in parallel anyway, use 4 threads so their long waits overlap.
for t in "$here"/tests/*; do
  case "$(basename "$t")" in
    tests-api_host | tests-async_host | tests-ecosystem | tests-faults_host | tests-outside_rust | tests-outside_round4 | tests-queue_host | tests-reliability | tests-tcp_host | tests-views) threads=4 ;;
    *) threads=1 ;;
  esac
  step "test-$(basename "$t")" "$t" --test-threads=$threads
done
for e in "$here"/examples/*; do [ -e "$e" ] && step "example-$(basename "$e")" "$e"; done
# The Python package (its wheel installed offline into /tmp/site): its tests (the GPU ones run
# here, where torch and CUDA are), its examples, then its benchmark against torch.multiprocessing.
step python-tests "$here/python/run.sh" tests
step python-example-convert_torch_mp "$here/python/run.sh" example convert_torch_mp
step python-example-broadcast_weights "$here/python/run.sh" example broadcast_weights
step python-bench "$here/python/run.sh" bench --quick --json "${OUT:-$logs}/python-bench.json"
[ -f "$logs/python-bench.log" ] && cat "$logs/python-bench.log"
step bench-primitive-costs "$here/bin/primitive-costs"
[ -f "$logs/bench-primitive-costs.log" ] && cat "$logs/bench-primitive-costs.log"

[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$here" logs
echo
echo "=== GPU bundle summary ($(tr '\n' ';' < "$logs/gpus.txt")) ==="
printf '%s\n' "${summary[@]}"
echo "=== $failed failed ==="
[ $failed -eq 0 ]
