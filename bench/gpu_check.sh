#!/usr/bin/env bash
# The whole GPU check in one command (issue 21; `make gpu-check`), for a machine with one
# NVIDIA GPU, Python 3.12 with PyTorch, transformers and Triton, and no network (the lent
# H200: /work/.library/device/). About 5 minutes there; each stage has a time limit so the
# whole stays inside 8.
#   1. installs our other dependencies from the wheels carried in .whl/ (filled beforehand
#      by `make gpu-wheels` where there is network; bench/gpu_wheels.py);
#   2. runs the parity suite on CUDA (MOESERVE_TEST_DEVICE=cuda): every architecture greedy
#      token-identical to transformers in float32 and bf16 logits as close to its float32
#      ones as its own bf16, alone and in a continuous batch with chunked prefill and forced
#      preemption, prefix-cache hits, abort freeing every block, seeded sampling independent
#      of the batch, the MoE dispatch paths on the GPU;
#   3. runs bench/gpu_bench.py (copy rate, batch-1 decode against its bandwidth floor, 64
#      concurrent requests against transformers, where the step time goes), which prints a
#      summary table and writes bench/results/gpu_check.json.
# Where $OUT is set (the device tool brings back what is under it) the record, the logs and
# the JUnit report are written there too.
#
#   bash bench/gpu_check.sh                 # on the GPU machine (device tool: carry .whl)
#   bash bench/gpu_check.sh --cpu-dry-run   # anywhere: the same stages on the CPU with a tiny
#                                           # model and a few parity tests; the wheels are
#                                           # checked and installed into a scratch folder; no
#                                           # GPU figure, the record goes to a scratch folder
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
  --cpu-dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: $0 [--cpu-dry-run]" >&2; exit 2 ;;
esac
if [ -z "${PYTHON:-}" ]; then  # the image's python3 there; this checkout's virtualenv here
  PYTHON=python3
  [ "$DRY" = 1 ] && [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
export PYTHONPATH=$PWD  # this checkout first, whatever a virtualenv has installed
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
LOGS=${OUT:-$WORK}
mkdir -p "$LOGS"
export MOESERVE_CACHE_DIR=${MOESERVE_CACHE_DIR:-$WORK/cache} PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
stage() { echo; echo "=== [gpu-check ${SECONDS}s] $*"; }

stage "environment"
"$PYTHON" -c 'import platform, torch; print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
if [ "$DRY" = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
fi

stage "1. wheels (.whl/)"
if [ "$DRY" = 1 ] && [ ! -d .whl ]; then
  echo "no .whl/ here (make gpu-wheels fills it): skipped in the dry run"
else
  "$PYTHON" -m bench.gpu_wheels check || exit 1
  install=(-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
  if "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
    "$PYTHON" "${install[@]}" --target "$WORK/site" .whl/*.whl || exit 1
    [ "$DRY" = 0 ] && export PYTHONPATH="$PWD:$WORK/site"
  else  # the dry run on another Python: installed for 3.12 as the GPU machine would, not used
    platforms=()
    for tag in manylinux_2_{17,24,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
      platforms+=(--platform "$tag")
    done
    "$PYTHON" "${install[@]}" --target "$WORK/site" --python-version 3.12 --implementation cp \
      --only-binary=:all: "${platforms[@]}" .whl/*.whl || exit 1
  fi
  echo "installed $(ls .whl/*.whl | wc -l) wheels into $WORK/site"
fi

stage "2. parity suite"
if [ "$DRY" = 1 ]; then
  device=cpu limit=300
  tests=("tests/inference/test_parity.py::test_prefill_and_decode_logits_match[mixtral]"
    "tests/inference/test_parity.py::test_greedy_alone_matches_generate[mixtral]"
    "tests/inference/test_engine_api.py::test_abort_mid_generation_frees_every_block")
else
  device=cuda limit=210
  tests=(tests/inference/test_parity.py tests/inference/test_llama.py
    tests/inference/test_arch_variants.py tests/inference/test_moe_dispatch.py
    "tests/inference/test_engine_api.py::test_abort_mid_generation_frees_every_block"
    "tests/inference/test_engine_api.py::test_n_samples_and_seed_reproducibility")
fi
MOESERVE_TEST_DEVICE=$device timeout "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider \
  -o timeout=120 --junitxml="$LOGS/parity.xml" "${tests[@]}" 2>&1 | tee "$LOGS/pytest.log"
parity_rc=${PIPESTATUS[0]}
echo "parity suite exit status: $parity_rc"

stage "3. benchmark"
if [ "$DRY" = 1 ]; then
  record="$LOGS/gpu_check_dry_run.json" bench=(--cpu-dry-run --section-limit 60)
else
  record=bench/results/gpu_check.json bench=(--section-limit 80)
fi
timeout 250 "$PYTHON" -m bench.gpu_bench "${bench[@]}" --out "$record" --model-dir "$WORK/model" \
  --parity-junit "$LOGS/parity.xml" --parity-rc "$parity_rc" 2>&1 | tee "$LOGS/bench.log"
bench_rc=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ "$DRY" = 0 ] && [ -f "$record" ]; then
  cp "$record" "$OUT/gpu_check.json"
fi

stage "done: parity exit status $parity_rc, benchmark exit status $bench_rc; record $record"
rm -rf "$WORK/site" "$WORK/cache" "$WORK/model"
[ "$parity_rc" = 0 ] && [ "$bench_rc" = 0 ]
