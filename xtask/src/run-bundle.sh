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
  extra=$(grep -E '^test result:|ignored, |^(FAILED|SKIPPED|ERROR) |^=+ .*(passed|failed|error).* =+$' "$log" | sed 's/^/    /' | head -20)
  summary+=("$(printf '%-40s %-14s %3ss' "$name" "$verdict" $((SECONDS - start)))")
  [ -n "$extra" ] && summary+=("$extra")
  [ $rc -eq 0 ] || tail -30 "$log"
}

nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader > "$logs/gpus.txt" 2>&1
for t in "$here"/tests/*; do step "test-$(basename "$t")" "$t" --test-threads=1; done
for e in "$here"/examples/*; do [ -e "$e" ] && step "example-$(basename "$e")" "$e"; done
# The Python package: the wheel and pytest installed offline into /tmp/site, then its tests (the
# GPU ones among them run here, where torch and CUDA are).
python_tests='site=/tmp/site; rm -rf $site
  python3 -m pip install --quiet --no-index --no-deps --target $site "$0"/python/*.whl "$0"/python/test-wheels/*.whl || exit 1
  PYTHONPATH=$site exec python3 -m pytest -q -rs -p no:cacheprovider "$0/python/tests"'
step python-tests bash -c "$python_tests" "$here"
step bench-primitive-costs "$here/bin/primitive-costs"
[ -f "$logs/bench-primitive-costs.log" ] && cat "$logs/bench-primitive-costs.log"

[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$here" logs
echo
echo "=== GPU bundle summary ($(tr '\n' ';' < "$logs/gpus.txt")) ==="
printf '%s\n' "${summary[@]}"
echo "=== $failed failed ==="
[ $failed -eq 0 ]
