#!/usr/bin/env bash
# Installs the pinned torch without a GPU's worth of downloads.
#
# PyPI's Linux wheel of torch is the CUDA build: it pulls about 20 nvidia-*/cuda-*/triton packages
# (several GB) even on a machine without a GPU. The CPU build lives on PyTorch's own CPU wheel
# index, so a machine without an NVIDIA driver installs from there. Set SPECDEC_TORCH=cuda to take
# PyPI's CUDA build instead (a GPU machine), or SPECDEC_TORCH=cpu to force the CPU build.
# Idempotent: an installed torch of the pinned version is kept.
set -euo pipefail

TORCH_VERSION="2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
PYTHON="${PYTHON:-python3}"

installed="$("${PYTHON}" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "${installed%%+*}" == "${TORCH_VERSION}" ]]; then
    echo "torch ${installed} already installed"
    exit 0
fi

flavour="${SPECDEC_TORCH:-}"
if [[ -z "${flavour}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi
case "${flavour}" in
    cpu)  "${PYTHON}" -m pip install --quiet "torch==${TORCH_VERSION}" --index-url "${CPU_INDEX}" \
              --extra-index-url https://pypi.org/simple ;;
    cuda) "${PYTHON}" -m pip install --quiet "torch==${TORCH_VERSION}" ;;
    *)    echo "SPECDEC_TORCH must be cpu or cuda, got ${flavour}" >&2; exit 2 ;;
esac
