#!/usr/bin/env bash
# `kvlink demo --device cuda` on a GPU host (issue 25): prefill and decode KV caches in VRAM on
# one GPU, filled and verified there (every byte), over
#   1. cuda_ipc                      (--transport cuda_ipc; the JSON is $OUT/demo_cuda_ipc.json)
#   2. the default list on CUDA      (cuda_ipc,nixl,tcp: the summary names the one used)
#   3. cuda_ipc, TP 2 -> 1, HND      (heterogeneous TP, both sides' ranks on the one GPU)
#   4. tcp, staged through pinned host memory (needs no NIXL)
#   5. nixl                          (only where `import nixl._api` works; else skipped, saying why)
# Each run is under `timeout 120`. Exit 0 when every run that ran verified every byte.
#
#   OUT=/tmp/out scripts/gpu_demo_check.sh     # JSONs land in $OUT (default: a new temp dir)
#   PYTHON=/path/to/python scripts/gpu_demo_check.sh
# Needs torch with CUDA, numpy, msgspec and click (rich for the bar; optional); runs from the
# source tree (no pip install needed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
failed=()
ran=0

"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                             f"{torch.cuda.device_count()} device(s): "
                             f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}")' \
  || { echo "gpu_demo_check: torch does not import" >&2; exit 2; }

summary() {  # name json -> one line from the run's own JSON
  "$PY" - "$2" "$1" <<'PY'
import json, sys
path, name = sys.argv[1:]
try:
    r = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"  {name}: no result ({exc})")
    sys.exit(0)
print(f"  {name}: transport {r['transport']} (tried {','.join(r.get('transports', []))}), "
      f"{r.get('device')} -> {r.get('decode_device')}, {r['bytes'] / 2**30:.2f} GiB, "
      f"{r['gbps']:.2f} GB/s, verified {r['verified']}, rank failures {r['rank_failures']}")
PY
}

run() {  # name args...
  local name=$1; shift
  local json="$OUT/$name.json"
  rm -f "$json"
  echo
  echo "== $name: kvlink demo $* --json $json"
  timeout 120 "$PY" -m kvlink.cli demo "$@" --json "$json"
  local rc=$?
  ran=$((ran + 1))
  [[ $rc == 124 ]] && echo "== $name: TIMED OUT after 120 s"
  echo "== $name: exit code $rc"
  if [[ $rc != 0 ]]; then failed+=("$name (exit $rc)"); fi
  RESULTS+=("$name|$json")
}
RESULTS=()

run demo_cuda_ipc --device cuda --transport cuda_ipc
run demo_cuda_default --device cuda
run demo_cuda_ipc_tp2to1_hnd --device cuda --transport cuda_ipc --prefill-tp 2 --decode-tp 1 \
    --layout HND
run demo_tcp_staged --device cuda --transport tcp --cache-gib 0.25 --requests 2

if why=$("$PY" -c 'import nixl._api' 2>&1); then
  run demo_nixl --device cuda --transport nixl
else
  echo
  echo "== demo_nixl: SKIPPED: nixl does not import here ($(echo "$why" | tail -n1))"
fi

echo
echo "== summary ($ran runs; JSON in $OUT)"
for r in "${RESULTS[@]}"; do summary "${r%%|*}" "${r#*|}"; done
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all $ran runs verified every byte"
