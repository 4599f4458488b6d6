#!/usr/bin/env bash
# Two GPUs (every route, two nodes of one GPU, AutoPolicy) on nvidia-h200-x2, one device call
# per part set (each < 10 minutes):
#   PARTS=m17     Qwen3-1.7B, B=4 and B=32 per GPU: ours on 1 GPU and on 2 GPUs over the four
#                 routes (predicted afterwards: slidedp bench predict REPORT --probes DIR)
#   PARTS=p2      the host and layer probes, the routes m17 did not reach, Qwen3-4B B=16
#   PARTS=probes  the layer probes alone (any H200: the same GPU as the x2 machine's)
#   PARTS=nodes   two one-GPU "nodes" over NCCL's socket transport against one node of two
#                 GPUs (100 steps, bf16 parity and the cross-node step cost), the GPU tests of
#                 several nodes and of AutoPolicy on 2 GPUs, then auto vs the fixed default
#                 (Qwen3-1.7B B=16 per GPU, same call, with the step-time model's prediction)
#   PARTS=x2a     the nodes check, then AutoPolicy on 2 GPUs beside the fixed default (the GPU
#                 tests of both only in the time left)
#   PARTS=x2b     the host probe, then Qwen3-4B B=16 on the gpu and the cpu route
#   PARTS=auto    x2a's AutoPolicy part alone (LIMIT seconds, 500)
#   PARTS=x2c     the Qwen3-1.7B routes not yet measured: B=4 sharded/gpu, B=32 sharded/cpu (the
#                 second machine ran B=4 on both cpu routes)
#   PARTS=cpu     the cpu route's miss (benchmarks/2026-11-27-two-gpus-routes-h200.md): the
#                 host probe, the ranks'
#                 host pools on all cores against each rank's share (benches/ranks_host_threads.py),
#                 a traced Qwen3-1.7B B=4 step on replicated/cpu (one trace per rank), then the
#                 same run with runtime.update_threads at each rank's share of the cores
#   PARTS=4b      Qwen3-4B B=4 on every route (LIMIT seconds, 540; 1 GPU and 4 routes, ~100 s each)
#   PARTS=4b16    Qwen3-4B B=16 on the sharded routes (LIMIT seconds, 540)
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist"], command `PARTS=m17 bash benches/gpu_two.sh`
# Layer compute: eager (Liger not installed here, so no Triton compile on a fresh machine);
# clipping 1.0 (the default); the BF16 mirror on for one GPU too (this host's MemTotal starts
# small and grows, so the default would decide from too little).
OUT=${OUT:-out/gpu-two}
LIGER=0 source "$(dirname "$0")/gpu_common.sh"
routes() {  # routes SHAPE BATCH ROUTES SECONDS [BENCH ARGS...]
    part "$1-b$2" "$4" python3 -m slidedp bench train --shape "$1" --batch "$2" --gpus 2 \
        --routes "$3" --systems ours --warmup 2 --steps 3 \
        --set runtime.bf16_mirror=true --json "$OUT/$1-b$2.json" "${@:5}"
}
host_probe() {  # the host AdamW rate alone and under the copies
    part host 60 python3 -m slidedp.bench.predict host '{"device": "cuda", "ranks": 2}' "$OUT/host.json"
}
nodes_check() {  # two one-GPU nodes over NCCL's sockets against one node of two GPUs
    part nodes 150 python3 -m slidedp bench nodes --device cuda --nodes 2 --ranks 1 \
        --steps 100 --nccl-net --json "$OUT/nodes-2x1.json"
}
auto_pair() {  # auto_pair SECONDS [BENCH ARGS...]: AutoPolicy beside the fixed default
    part auto-2gpu "$1" python3 -m slidedp bench train --shape qwen3-1.7b --batch 16 --gpus 2 \
        --routes replicated/gpu,auto --systems ours --warmup 2 --steps 3 \
        --json "$OUT/qwen3-1.7b-b16-auto.json" "${@:2}"
}
case ${PARTS:-m17} in
    probes) for sb in qwen3-1.7b:4 qwen3-1.7b:32 qwen3-4b:4 qwen3-4b:16; do
            layer "${sb%:*}" "${sb#*:}"; done ;;
    # each run starts in about 60 s here (a fresh store faults in at ~3 s per 8 GiB)
    m17) routes qwen3-1.7b 4 all 230; routes qwen3-1.7b 32 all 320 ;;
    p2) host_probe
        for sb in qwen3-1.7b:4 qwen3-1.7b:32 qwen3-4b:16; do layer "${sb%:*}" "${sb#*:}"; done
        routes qwen3-1.7b 4 replicated/cpu,sharded/gpu,sharded/cpu 240
        routes qwen3-4b 16 replicated/gpu 200 ;;
    nodes) nodes_check
        part gpu-tests 200 python3 -m pytest -q -s -p no:cacheprovider -m multi_gpu \
            tests/multirank/test_gpu_nodes.py tests/autopolicy/test_auto_gpus.py
        within 200 auto-2gpu && auto_pair 200 --predict ;;
    x2a) nodes_check
        within 400 auto-2gpu && auto_pair 400
        within 120 gpu-tests && part gpu-tests $((560 - SECONDS)) python3 -m pytest -q -s \
            -p no:cacheprovider -m multi_gpu tests/multirank/test_gpu_nodes.py ;;
    auto) auto_pair "${LIMIT:-500}" ;;
    x2b) host_probe
        routes qwen3-4b 16 replicated/gpu,replicated/cpu $((560 - SECONDS)) ;;
    x2c) routes qwen3-1.7b 4 sharded/gpu 250; routes qwen3-1.7b 32 sharded/cpu 280 ;;
    cpu) host_probe
        part threads 120 python3 benches/ranks_host_threads.py
        routes qwen3-1.7b 4 replicated/cpu 200 --trace "$OUT/cpu-route.json"
        # the same with each rank's host pools on its share of the cores (a later --json wins)
        within 200 share && routes qwen3-1.7b 4 replicated/cpu 200 \
            --set runtime.update_threads=$(($(nproc) / 2)) --json "$OUT/qwen3-1.7b-b4-share.json" ;;
    4b) routes qwen3-4b 4 all "${LIMIT:-540}" ;;
    4b16) routes qwen3-4b 16 sharded/gpu,sharded/cpu "${LIMIT:-540}" ;;
esac
grep -E "^ +[0-9]+ +[12] |step-time model|== " "$LOG" | tail -30
