#!/usr/bin/env bash
# The GPU-machine check of `tq doctor`: runs `tq doctor --measure --json` (60 s at most) and
# `nvidia-smi topo -m`, prints both, then one PASS/FAIL line per check:
#   1. the command exits 0;
#   2. every handle kind crossed between two processes (verdict "ok");
#   3. the GPU0 -> GPU1 link is "nvlink" in the JSON exactly when nvidia-smi shows NV# for it;
#   4. the small-message section was measured and suggests a threshold (`inline.suggested_up_to`).
# Usage: tensor-queue/cli/doctor-gpu-check.sh   (TQ=/path/to/tq to skip the build; JSON via jq if present, else python3)
set -u
cd "$(dirname "$0")/../.."

if [ -z "${TQ:-}" ]; then
    cargo build --quiet --package tq --bin tq || { echo "FAIL: building tq"; exit 1; }
    target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
    TQ="$target_dir/debug/tq"
fi

json_file=$(mktemp)
trap 'rm -f "$json_file"' EXIT
timeout 60 "$TQ" doctor --measure --json >"$json_file"
status=$?
echo "== tq doctor --measure --json (exit $status)"
cat "$json_file"
echo "== nvidia-smi topo -m"
# Without colour codes, so that the matrix parses.
topo=$(nvidia-smi topo -m 2>&1 | sed 's/\x1b\[[0-9;]*m//g')
echo "$topo"

# `handles_ok`: "yes" if every handle kind is ok; `link01`: the JSON's GPU0 -> GPU1 link kind.
if command -v jq >/dev/null; then
    handles_ok=$(jq -r 'if (.handles | length) > 0 and all(.handles[]; .verdict == "ok") then "yes" else "no" end' "$json_file" 2>/dev/null)
    link01=$(jq -r '[.pairs[] | select(.source == 0 and .target == 1) | .link][0] // "none"' "$json_file" 2>/dev/null)
    inline_ok=$(jq -r 'if .inline.measured == true and (.inline.suggested_up_to | type) == "number" then "yes" else "no" end' "$json_file" 2>/dev/null)
else
    read -r handles_ok link01 inline_ok < <(python3 - "$json_file" <<'PY'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except Exception:
    print("no none no"); sys.exit()
handles = report.get("handles", [])
ok = "yes" if handles and all(h.get("verdict") == "ok" for h in handles) else "no"
links = [p["link"] for p in report.get("pairs", []) if p.get("source") == 0 and p.get("target") == 1]
inline = report.get("inline", {})
inline_ok = "yes" if inline.get("measured") is True and isinstance(inline.get("suggested_up_to"), int) else "no"
print(ok, links[0] if links else "none", inline_ok)
PY
)
fi

# nvidia-smi's cell for row GPU0, column GPU1 (NV# for NVLink; PIX, PXB, PHB, NODE, SYS otherwise).
cell01=$(echo "$topo" | awk '
    /^[[:space:]]+GPU0/ && !header { for (i = 1; i <= NF; i++) if ($i == "GPU1") col = i; header = 1; next }
    header && $1 == "GPU0" && col { print $(col + 1); exit }')
echo "== checks (nvidia-smi GPU0-GPU1: ${cell01:-none}; tq: ${link01:-none})"

failures=0
verdict() { if [ "$1" = yes ]; then echo "PASS: $2"; else echo "FAIL: $2"; failures=$((failures + 1)); fi; }
verdict "$([ "$status" -eq 0 ] && echo yes || echo no)" "tq doctor --measure --json exits 0 (got $status)"
verdict "$handles_ok" "every handle kind crosses between two processes"
verdict "${inline_ok:-no}" "tq doctor --measure suggests a small-message inline threshold"
smi_nvlink=$([[ "${cell01:-}" =~ ^NV[0-9]+$ ]] && echo yes || echo no)
tq_nvlink=$([ "${link01:-}" = nvlink ] && echo yes || echo no)
verdict "$([ -n "${cell01:-}" ] && [ "$smi_nvlink" = "$tq_nvlink" ] && echo yes || echo no)" \
    "GPU0<->GPU1 is NVLink in tq ($tq_nvlink) iff nvidia-smi shows NV# ($smi_nvlink)"
exit $((failures > 0))
