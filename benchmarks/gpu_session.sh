#!/usr/bin/env bash
# Everything griffin measures on an NVIDIA GPU, in steps sized for a lent machine (10 minutes a call, about 15
# minutes of device time a session), which has PyTorch, Triton and transformers but no internet. From the
# repository root on the GPU machine:
#
#   bash benchmarks/gpu_session.sh STEP [STEP ...]
#
#   scan          the RG-LRU kernel, and with save_states, against copy and fla's chunked HGRN kernel (the fastest
#                 peer on 2026-11-28): B=8, T=2K/8K, D=1024/2560, bf16 and fp32, forward and forward+backward, eager
#                 and CUDA-graph (~2 min)
#   scan-peers    the same shapes against every peer: accelerated-scan, fla's recurrent and chunked HGRN (~2.5 min)
#   tests         the Triton kernels at full size, the CUDA paths of the model, compile and inference tests (over
#                 2.5 min: on 2026-11-30 it was still running at 150 s)
#   tests-scan    the RG-LRU kernel's tests alone (full size, torch.compile, CUDA graph; ~1 min)
#   train         the training step at 400M (Appendix C), bf16 autocast, tokens/s and MFU, T = 2K and 8K (~2 min)
#   train-compiled  the same at T = 2K with the model compiled (torch.compile; ~3 min, most of it compiling)
#   train-1b      the compiled training step at 1.3B (Appendix C), T = 2K (~3 min)
#   decode        MQA, Hawk, Griffin at 1B: decode latency at batch 64 (empty and 1K prompt), throughput to batch
#                 128, decode bandwidth against copy, and HF generate on the same Griffin weights (~2.5 min; the
#                 eager step is ~30 ms at batch 64: on 2026-11-28 throughput to batch 256 ran past the limit)
#   decode-graph  Griffin 1B decoded by the torch.compile'd step (CUDA graphs), batch 1 and 64 (~1.5 min)
#   serve         benchmarks/serve_load.py --device cuda: a 0.6B byte-level Griffin in bf16, 1, 32 and 256 closed-loop
#                 clients against HF generate one request at a time (~3 min; on 2026-11-28 the chat and few-shot
#                 workloads it then also ran kept HF out of the limit: they are left out now)
#   serve-graph   the same server with --compile (its decode step as CUDA graphs, one per batch bucket up to 32;
#                 compiling them is most of the ~4 min), 1 and 32 clients
#   sweep         scan_gpu.py --sweep: kernel tile configurations (choose select_config's tables per GPU; ~4 min)
#   fig9b, local  Figure 9b (hawk_scan_backends.py) and local attention (FlexAttention) on CUDA
#
# Not yet measured on a GPU (docs/performance.md), in the order of what they decide, for the next lease: one call of
# `scan train-compiled serve-graph` (~9 min; scan times the save_states backward, serve-graph needs the server's
# wheels below), then `decode train-1b`. Each start of a machine costs 1-2 minutes of the lease.
#
# Wheels the image lacks travel with the working tree (no internet there): on a machine with internet, from the
# repository root (.whl is in .git/info/exclude; the device tool's `carry: [".whl"]`),
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
#       accelerated-scan==0.3.1 fla-core==0.6.0 starlette uvicorn pydantic pydantic-core annotated-types \
#       typing-inspection openai distro jiter sniffio
#
# (the peers of `scan`; the server and client of `serve`). They are installed into a scratch folder, not the image.
# Results go to $OUT when it is set (the device tool's folder that comes back: at most 8 files), else to
# benchmarks/results; each step's output is also appended to session.log there.
set -euo pipefail

RESULTS="${OUT:-benchmarks/results}"
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=python3
LOG="$RESULTS/session.log"

WHEELS=$(compgen -G ".whl/*.whl" || compgen -G "benchmarks/wheels/*.whl" || true)
if [ -n "$WHEELS" ]; then
    SITE="$(mktemp -d)"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" $WHEELS
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA GPU'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"

# run NAME SECONDS CMD...: one step, stopped (SIGINT, then KILL) if it outlives its share of the call
run() {
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*" | tee -a "$LOG"
    local start=$SECONDS status=0
    timeout --signal=INT --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG" || status=$?
    echo "=== $name: exit $status after $((SECONDS - start)) s" | tee -a "$LOG"
}

for step in "$@"; do
    case "$step" in
        scan)
            run scan 150 "$PY" benchmarks/scan_gpu.py --shapes 8x2048x1024 8x8192x1024 8x2048x2560 8x8192x2560 \
                --dtypes bf16 fp32 --impls fla-hgrn-chunk --out "$RESULTS/scan_gpu.json" ;;
        scan-peers)
            run scan-peers 150 "$PY" benchmarks/scan_gpu.py --shapes 8x2048x1024 8x8192x1024 8x2048x2560 \
                8x8192x2560 --dtypes bf16 fp32 --impls accelerated-scan fla-hgrn-recurrent fla-hgrn-chunk \
                --out "$RESULTS/scan_gpu_peers.json" ;;
        tests)
            run tests 200 "$PY" -m pytest -q --tb=short -p no:cacheprovider -m "slow or not slow" \
                tests/ops tests/layers tests/test_model.py tests/test_compile.py \
                tests/inference tests/benchmarks/test_scan_peers.py -k "cuda or full_size or graph or triton" ;;
        tests-scan)
            run tests-scan 120 "$PY" -m pytest -q --tb=line -rf -p no:cacheprovider -m "slow or not slow" \
                tests/ops/test_rg_lru_triton.py ;;
        train)
            run train 150 "$PY" benchmarks/train_speed.py --scale paper-400m --device cuda --seq-lens 2048 8192 \
                --warmup 2 --steps 5 --out "$RESULTS/train_speed_400m.json" --plot "" ;;
        train-compiled)
            run train-compiled 240 "$PY" benchmarks/train_speed.py --scale paper-400m --device cuda --compile \
                --seq-lens 2048 --warmup 2 --steps 5 --out "$RESULTS/train_speed_400m_compiled.json" --plot "" ;;
        train-1b)
            run train-1b 240 "$PY" benchmarks/train_speed.py --scale paper-1b --device cuda --compile \
                --seq-lens 2048 --warmup 2 --steps 5 --out "$RESULTS/train_speed_1b_compiled.json" --plot "" ;;
        decode)
            run decode 180 "$PY" benchmarks/inference.py --scale paper-1b --device cuda --dtype bfloat16 \
                --batch 64 --prompt 1024 --lengths 256 --throughput-lengths 256 --min-batch 64 --max-batch 128 \
                --memory-gb 60 --hf-lengths 128 --no-official --out "$RESULTS/inference_1b.json" --figures "" ;;
        decode-graph)
            run decode-graph 200 "$PY" benchmarks/inference.py --scale paper-1b --device cuda --dtype bfloat16 \
                --families griffin --compile --batch 1 --prompt 1024 --lengths 256 --throughput-lengths 256 \
                --min-batch 64 --max-batch 64 --memory-gb 60 --no-hf --no-official \
                --out "$RESULTS/inference_1b_graph.json" --figures "" ;;
        serve)
            run serve 200 "$PY" benchmarks/serve_load.py --device cuda --dtype bfloat16 --width 2048 --depth 12 \
                --heads 16 --window 1024 --concurrency 1 32 256 --requests 256 --max-batch 256 --hf-requests 12 \
                --workloads load --no-chat --no-static --threads 8 --out "$RESULTS/serve_load_cuda.json" \
                --figure "" ;;
        serve-graph)
            run serve-graph 280 "$PY" benchmarks/serve_load.py --device cuda --dtype bfloat16 --width 2048 --depth 12 \
                --heads 16 --window 1024 --concurrency 1 32 --requests 64 --max-batch 32 --hf-requests 6 --compile \
                --workloads load --no-chat --no-static --threads 8 --out "$RESULTS/serve_load_cuda_graph.json" \
                --figure "" ;;
        sweep)
            run sweep 280 "$PY" benchmarks/scan_gpu.py --sweep --out "$RESULTS/scan_gpu_sweep.json" ;;
        fig9b)
            run fig9b 200 "$PY" benchmarks/hawk_scan_backends.py --device cuda --width 1024 --depth 12 \
                --seq-len 2048 --batch 8 --backends native associative fused \
                --out "$RESULTS/hawk_scan_backends_cuda.json" --plot "$RESULTS/hawk_scan_backends_cuda.png" ;;
        local)
            run local 150 "$PY" benchmarks/local_attention.py --device cuda --dtype bfloat16 --flex \
                --out "$RESULTS/local_attention_cuda.json" ;;
        *)
            echo "unknown step: $step (scan, scan-peers, tests, tests-scan, train, train-compiled, train-1b, decode," \
                "decode-graph, serve, serve-graph, sweep, fig9b, local)" >&2
            exit 2 ;;
    esac
done
