#!/usr/bin/env bash
# The prepared GPU check for a lent CUDA machine (the image's python3 holds torch,
# transformers, pytest; nothing can be fetched there). From the repository root:
#
#     bash bench/gpu_run.sh            # logs also under $OUT when it is set
#
# Runs the CUDA tests (CUDA graphs, CUDA vs CPU, the MTP device chain with PyTorch's sync
# debug mode set to "error") and `python -m bench gpu_check`. FlashInfer is not in the
# image and its wheel (flashinfer-python 0.7.4: 101 MB) is over what a call can carry, so
# the FlashInfer rows and tests report themselves skipped; the decoder rows need
# SmolLM2-135M-Instruct in the model cache and are skipped without it.
set -u -o pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-/tmp}"
py="${PYTHON:-python3}"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
"$py" -m pytest -q -p no:cacheprovider tests/test_rose_gpu.py tests/test_paged_attention.py \
    2>&1 | tee "$out/gpu-tests.log"
tests=$?
"$py" -m bench gpu_check --iters=20 2>&1 | tee "$out/gpu-check.log"
check=$?
echo "gpu_run: tests exit $tests, gpu_check exit $check"
exit $((tests || check))
