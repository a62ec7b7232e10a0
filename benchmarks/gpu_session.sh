#!/usr/bin/env bash
# Everything griffin measures on an NVIDIA GPU, in steps that each fit a 10-minute call of a lent machine, which
# has PyTorch, Triton and transformers but no internet. From the repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh STEP [STEP ...]
#
#   tests   the Triton RG-LRU kernel (full size), local attention, the peers, compile (incl. CUDA graphs) and
#           inference tests, on the GPU, slow ones included
#   scan    benchmarks/scan_gpu.py: the RG-LRU kernel vs copy, the PyTorch loop, torch.compile, accelerated-scan
#           and fla (Figure 9a setting; issue 5)
#   fig9b   benchmarks/hawk_scan_backends.py on CUDA (Figure 9b; issue 5)
#   local   benchmarks/local_attention.py on CUDA in bf16, with FlexAttention (issue 5)
#   infer   benchmarks/inference.py at the paper's 1B scale, bf16, compiled decode (CUDA graphs) (Figure 1b, 4;
#           issue 3)
#   train   benchmarks/train_speed.py at the 400M scale (Figure 3; issue 2)
#
# The peers accelerated-scan and fla are used when their wheels were downloaded beforehand, on a machine with
# internet (einops is already on the GPU image):
#
#   pip download --no-deps -d benchmarks/wheels accelerated-scan==0.3.1 fla-core==0.6.0
#
# and carried along (the device tool's `carry: ["benchmarks/wheels"]`). Results go to $OUT when it is set (the
# device tool's folder that comes back), else to benchmarks/results.
set -euo pipefail

RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=python3

if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
    PEERS="$(mktemp -d)"
    "$PY" -m pip install -q --no-deps --no-index --target "$PEERS" benchmarks/wheels/*.whl
    export PYTHONPATH="$PYTHONPATH:$PEERS"
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print(torch.cuda.get_device_name())"

for step in "$@"; do
    echo "=== $step ($(date -u +%H:%M:%S))"
    case "$step" in
        tests)
            "$PY" -m pytest -q -m "slow or not slow" tests/ops tests/layers \
                tests/benchmarks/test_scan_peers.py tests/test_compile.py tests/test_model.py tests/inference 2>&1 | tail -n 30 ;;
        scan)
            "$PY" benchmarks/scan_gpu.py --compile-budget-s 120 --out "$RESULTS/scan_gpu.json" ;;
        fig9b)
            "$PY" benchmarks/hawk_scan_backends.py --device cuda --width 1024 --depth 12 --seq-len 2048 --batch 8 \
                --backends native associative fused --out "$RESULTS/hawk_scan_backends_cuda.json" \
                --plot "$RESULTS/hawk_scan_backends_cuda.png" ;;
        local)
            "$PY" benchmarks/local_attention.py --device cuda --dtype bfloat16 --flex \
                --out "$RESULTS/local_attention_cuda.json" ;;
        infer)
            "$PY" benchmarks/inference.py --scale paper-1b --device cuda --dtype bfloat16 --compile \
                --out "$RESULTS/inference_1b.json" --figures "$RESULTS" ;;
        train)
            "$PY" benchmarks/train_speed.py --scale paper-400m --device cuda --out "$RESULTS/train_speed_400m.json" \
                --plot "$RESULTS/train_speed_400m.png" ;;
        *)
            echo "unknown step: $step (tests, scan, fig9b, local, infer, train)" >&2
            exit 2 ;;
    esac
done
