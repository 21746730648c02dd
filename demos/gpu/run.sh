#!/usr/bin/env bash
# Run ON the lent GPU machine, in the repository root, one stage per device call (a call may
# carry at most 64 MiB and run at most 10 minutes; the machine keeps /tmp while it is warm, so
# make the calls back to back). demos/gpu/README.md lists the calls with what each carries.
#   install   wheels and this tree's package into /tmp/site; model part aa
#   part      model part ab
#   model     model part ac; the GGUF joined and checked; the GPU tests
#   bench8b   Llama-3-8B shapes, random weights: bench ttft, store (per tier)
#   prefix8b  the same model: bench prefix with the Triton shared phase, then with torch's
#   smollm2   SmolLM2: bench ttft per dtype and the development-set eval
# Results go under $OUT (json + png, at most 8 files a call), to be committed under
# demos/results/gpu/. DEVICE=cpu MODEL=random:tiny SMALL=1 dry-runs the bench stages here.
set -euo pipefail
cd "$(dirname "$0")/../.."
stage=${1:?stage: install | part | model | bench8b | prefix8b | smollm2}
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3-8b}
export PYTHONUNBUFFERED=1 RAG_KVCACHE_HOME=/tmp/rag-kvcache
PARTS=/tmp/rag-kvcache/gguf-parts
if [ "$DEVICE" != cpu ]; then
  export PYTHONPATH=/tmp/site RAG_KVCACHE_MODEL=/tmp/rag-kvcache/SmolLM2-135M-Instruct.Q4_1.gguf
fi
cli() { python3 -P -m rag_kvcache.tools.cli "$@"; }  # -P: the installed package, not ./rag_kvcache
if [ "$DEVICE" = cpu ]; then cli() { .venv/bin/rag-kvcache "$@"; }; fi
collect_parts() { mkdir -p "$PARTS" && cp .gpu-model/smollm2.gguf.* "$PARTS"/; }
case "$stage" in
install)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --upgrade --target /tmp/site .  # this package as sent, not a wheel built earlier
  collect_parts
  python3 -P -c 'import torch, transformers, rag_kvcache; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'
  ;;
part)
  collect_parts
  ls -la "$PARTS"
  ;;
model)
  collect_parts
  cat "$PARTS"/smollm2.gguf.part-* >"$RAG_KVCACHE_MODEL"
  test "$(sha256sum <"$RAG_KVCACHE_MODEL" | cut -d' ' -f1)" = "$(cat "$PARTS"/smollm2.gguf.sha256)"
  python3 -P -m pytest -q -rs tests/test_gpu.py tests/test_linker.py tests/test_cascade.py \
    tests/test_batch_kv.py 2>&1 | tee "$OUT/gpu-tests.log"
  ;;
bench8b)
  ctx=${SMALL:+1024,2048}; ctx=${ctx:-1024,2048,4096,8192,16384}
  cli bench ttft --device "$DEVICE" --model "$MODEL" --dtypes bfloat16 --contexts "$ctx" --out "$OUT/ttft"
  cli bench store --device "$DEVICE" --model "$MODEL" --dtypes bfloat16 --contexts "$ctx" --redis-url '' --out "$OUT/store"
  ;;
prefix8b)
  pfx=${SMALL:+512}; pfx=${pfx:-1024,2048,4096}
  cli bench prefix --device "$DEVICE" --model "$MODEL" --dtype bfloat16 --prefixes "$pfx" --batches 1,8,32 --new-tokens 64 --out "$OUT/prefix"
  RAG_KVCACHE_TRITON=0 cli bench prefix --device "$DEVICE" --model "$MODEL" --dtype bfloat16 --prefixes "$pfx" --batches 8,32 --new-tokens 64 --out "$OUT/prefix-torch"
  ;;
smollm2)
  cli bench ttft --device "$DEVICE" --dtypes float32,bfloat16 --contexts 1024,2048,4096 --out "$OUT/ttft"
  cli eval tests/data/dev_qa.jsonl --device "$DEVICE" ${SMALL:+--limit 2} --out "$OUT/eval"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
