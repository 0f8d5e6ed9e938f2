#!/usr/bin/env bash
# Run vLLM's own scheduler tests (tests/v1/core/test_scheduler.py of the pinned version)
# with engine_adapter.vllm's classes as the scheduler, policy vllm-fcfs in-process.
#
# vLLM's code is not copied into this repository: the pinned sdist is downloaded with
# pip into .tools/vllm-sdist (once), the few test files are extracted into the ignored
# .tools/vllm-tests/, and tools/vllm_suite_plugin.py swaps the scheduler classes in.
#
#   tools/vllm_tests.sh [PYTHON] [extra pytest args]     (default PYTHON: .venv/bin/python)
# Exit status: 0 when every test passes or fails only as listed in tools/vllm_suite_expected.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}; shift || true
# Absolute, without resolving the venv's symlink (that would leave the venv): the suite
# runs from another directory.
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm'))")
SDIST_DIR=.tools/vllm-sdist
DEST=.tools/vllm-tests/$VERSION
SDIST=$SDIST_DIR/vllm-$VERSION.tar.gz
if [ ! -f "$SDIST" ]; then
  mkdir -p "$SDIST_DIR"
  # pip prepares the sdist's metadata by running vLLM's setup.py, which fails for
  # VLLM_TARGET_DEVICE=cpu (a CPU build needs its own toolchain): download without it.
  env -u VLLM_TARGET_DEVICE "$PY" -m pip download -q "vllm==$VERSION" --no-binary :all: --no-deps \
    --no-build-isolation -d "$SDIST_DIR"
fi
if [ ! -f "$DEST/tests/v1/core/test_scheduler.py" ]; then
  mkdir -p "$DEST"
  files=(tests/__init__.py tests/v1/__init__.py tests/v1/core/__init__.py tests/v1/core/utils.py
         tests/v1/core/test_scheduler.py tests/v1/core/test_prefix_caching.py tests/v1/kv_connector/__init__.py
         tests/v1/kv_connector/unit/__init__.py tests/v1/kv_connector/unit/utils.py)
  tar -xzf "$SDIST" -C "$DEST" --strip-components=1 "${files[@]/#/vllm-$VERSION/}"
fi
ROOT=$PWD
# The tests name facebook/opt-125m; only its config is read.  Serve an offline hub cache
# holding just that config.json (public model metadata, written here) instead of the network.
HF_HOME_DIR=$ROOT/.tools/hf-home
SNAP=$HF_HOME_DIR/hub/models--facebook--opt-125m/snapshots/0000000000000000000000000000000000000000
if [ ! -f "$SNAP/config.json" ]; then
  mkdir -p "$SNAP" "$HF_HOME_DIR/hub/models--facebook--opt-125m/refs"
  printf '0000000000000000000000000000000000000000' > "$HF_HOME_DIR/hub/models--facebook--opt-125m/refs/main"
  cat > "$SNAP/config.json" <<'JSON'
{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "ffn_dim": 3072,
 "num_attention_heads": 12, "num_hidden_layers": 12, "max_position_embeddings": 2048,
 "vocab_size": 50272, "word_embed_proj_dim": 768, "do_layer_norm_before": true,
 "activation_function": "relu", "enable_bias": true, "torch_dtype": "float16",
 "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2}
JSON
fi
export HF_HOME=$HF_HOME_DIR HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$DEST"
# vLLM's own conftest (tests/conftest.py) pulls in model runners and is not needed here.
# Two runs: vLLM's own classes (baseline: tests that cannot run here, e.g. models that are
# not in the offline cache, fail there too) and ours; only tests that pass on the baseline
# and fail with our classes fail this script.
run() {
  VLLM_TARGET_DEVICE=cpu SLIDINGSERVE_ADDRESS=inproc SLIDINGSERVE_DEPLOYMENT=vllm-fcfs \
  PYTHONPATH="$ROOT:$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" -m pytest tests/v1/core/test_scheduler.py -q -rfE -p no:cacheprovider --rootdir "$PWD" \
    -c /dev/null -p tools.vllm_suite_plugin -o addopts="" --timeout 600 "$@" 2>&1
}
OUT=$ROOT/.tools/vllm-suite-$VERSION
mkdir -p "$OUT"
SLIDINGSERVE_SUITE_NATIVE=1 run "$@" > "$OUT/native.log" || true
run "$@" > "$OUT/adapter.log" || true
fails() { { grep -E '^(FAILED|ERROR) ' "$1" || true; } | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' | sort -u; }
passed() { grep -oE '[0-9]+ passed' "$1" | tail -1 | cut -d' ' -f1; }
fails "$OUT/native.log" > "$OUT/native.failed"
fails "$OUT/adapter.log" > "$OUT/adapter.failed"
echo "vLLM $VERSION scheduler suite, native classes: $(tail -1 "$OUT/native.log")"
echo "vLLM $VERSION scheduler suite, slidingserve (vllm-fcfs): $(tail -1 "$OUT/adapter.log")"
echo "(logs: $OUT; known differences: tools/vllm_suite_expected.txt)"
# A run that did not get going (import error, crash) fails nothing and passes nothing:
# insist that most of the suite actually ran with our classes.
MIN_PASSED=200
if [ "$(passed "$OUT/adapter.log" || echo 0)" -lt "$MIN_PASSED" ] 2>/dev/null || [ -z "$(passed "$OUT/adapter.log")" ]; then
  echo "the suite did not run with the adapter (fewer than $MIN_PASSED passed); see $OUT/adapter.log"
  tail -20 "$OUT/adapter.log"; exit 1
fi
NEW=$(comm -13 "$OUT/native.failed" "$OUT/adapter.failed")
if [ -n "$NEW" ]; then
  echo "FAILED with the adapter only:"; echo "$NEW"; exit 1
fi
echo "no failures beyond the native baseline"
