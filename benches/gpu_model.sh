#!/usr/bin/env bash
# The step-time model's error table on one GPU (one device call, < 10 minutes): the probes first,
# then the runs, each part with its own timeout; the predictions are made afterwards, here:
#   slidedp bench predict OUT/RUN.json --probes OUT
# Here first:  rm -f dist/*.whl; .venv/bin/maturin build --release -o dist/ -q
# Device call: carry ["dist"], command `PARTS=first bash benches/gpu_model.sh` (then second, ...)
# Layer compute: the default (eager kernels, compiled; Liger not installed here).
OUT=${OUT:-out/gpu-model}
LIGER=0 source "$(dirname "$0")/gpu_common.sh"
part host 60 python3 -m slidedp.bench.predict host '{"device": "cuda", "ranks": 1}' "$OUT/host.json"
BENCH=(python3 -m slidedp bench train --systems ours --warmup 2 --steps 3)
case ${PARTS:-first} in
    first)  # 5 runs: Qwen3-1.7B B=4..32 with clipping, Qwen3-4B B=16 without
        for b in 4 8 16 32; do layer qwen3-1.7b $b; done
        layer qwen3-4b 16
        part sweep-1.7b 300 "${BENCH[@]}" --shape qwen3-1.7b --sweep 4,8,16,32 \
            --json "$OUT/sweep-1.7b.json"
        part 4b-noclip 150 "${BENCH[@]}" --shape qwen3-4b --batch 16 \
            --set train.max_grad_norm=0 --json "$OUT/4b-b16-noclip.json" ;;
    second)  # Qwen3-4B: B=4 clipped, B=16 offload 1 unclipped, B=16 the mixed layout clipped
        layer qwen3-4b 4
        layer qwen3-4b 16 F 1
        layer qwen3-4b 16 SAC.mm,N
        part 4b-b4 150 "${BENCH[@]}" --shape qwen3-4b --batch 4 --json "$OUT/4b-b4.json"
        part 4b-offload 150 "${BENCH[@]}" --shape qwen3-4b --batch 16 \
            --set train.max_grad_norm=0 --set runtime.offload_ratio=1 \
            --json "$OUT/4b-b16-offload1-noclip.json"
        part 4b-mixed 150 "${BENCH[@]}" --shape qwen3-4b --batch 16 \
            --set "runtime.layers=24xSAC.mm, 12xN" --json "$OUT/4b-b16-mixed.json" ;;
    third)  # the mixed layout's probe; Qwen3-1.7B B=16 without the mirror; Qwen3-4B B=8 unclipped
        layer qwen3-4b 16 SAC.mm,N
        layer qwen3-1.7b 16
        layer qwen3-4b 8
        part 1.7b-cast 150 "${BENCH[@]}" --shape qwen3-1.7b --batch 16 \
            --set runtime.bf16_mirror=false --json "$OUT/1.7b-b16-cast.json"
        part 4b-b8 150 "${BENCH[@]}" --shape qwen3-4b --batch 8 --set train.max_grad_norm=0 \
            --json "$OUT/4b-b8-noclip.json" ;;
    fourth)  # the cast probe beside a run without the mirror; the mixed layout's probe again
        layer qwen3-4b 16 SAC.mm,N
        layer qwen3-1.7b 16
        part 1.7b-cast 150 "${BENCH[@]}" --shape qwen3-1.7b --batch 16 \
            --set runtime.bf16_mirror=false --json "$OUT/1.7b-b16-cast.json" ;;
    fifth)  # Qwen3-8B B=16, clipping (the default): a store of ~100 GB starts in minutes here
        layer qwen3-8b 16
        part 8b 420 "${BENCH[@]}" --shape qwen3-8b --batch 16 --json "$OUT/8b-b16.json" ;;
esac
grep -E "^ +[0-9]+ ours|== " "$LOG" | tail -20
