#!/usr/bin/env bash
# Run HERE (the CPU box), once, before using a lent GPU machine: gathers what that machine
# lacks into git-ignored folders that the device tool carries (64 MiB per call):
#   .whl/        Python 3.12 wheels: transformers 5.23 and the store's deps (this package
#                itself is installed there from the tree each call sends)
#   .gpu-model/  the SmolLM2 GGUF in 35 MiB parts (it is larger than one call may carry), and
#                its sha256 to check the joined file
# The machine already has torch, numpy, safetensors, tokenizers, huggingface-hub, rich, tqdm,
# matplotlib and pytest (see the device tool's KINDS.md); FAISS is not needed there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
test -x "$PY" || { echo "run 'make install' first"; exit 1; }
rm -rf .whl .gpu-model && mkdir -p .whl .gpu-model
pins=$("$PY" -m pip freeze | grep -iE '^(sqlalchemy|alembic|mako|redis|gguf|xxhash)==' || true)
test "$(echo "$pins" | wc -w)" = 6 || { echo "expected 6 pinned packages, got: $pins"; exit 1; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl transformers==5.23.0 $pins
gguf=$("$PY" -P -c 'from rag_kvcache.model import default_model_path; print(default_model_path())')
split -b 35m "$gguf" .gpu-model/smollm2.gguf.part-
sha256sum <"$gguf" | cut -d' ' -f1 >.gpu-model/smollm2.gguf.sha256
du -sh .whl .gpu-model
ls .whl .gpu-model
