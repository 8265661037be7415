#!/usr/bin/env bash
# gpu_fixtures.sh — make the transformers reference fixtures for the forward
# tests (issue 2).  Runs on the GPU machine from the repository root, with
# dsv4-mkmodel packed into .carry/ by tools/gpu-pack.sh; writes fixtures to
# $OUT.  The checkpoints are regenerated from preset + seed, so CI regenerates
# the same ones with its own dsv4-mkmodel.
#
#   A: preset tiny, seed 11, 640 positions (window 16, r=4 and r=128 crossed
#      several times, index top-k 8 of up to 160 entries)
#   B: preset small with other widths (D=384, head_dim=256, 16 experts top-4,
#      window 32, index 2 heads top-16), seed 12, 320 positions
#   tinyk, bk: A and B with index_topk=512 (every entry selected)
#   F: the flash widths (D=4096, 64 heads x 512, q/o rank 1024, index 64x128,
#      experts inter 2048) with 4 layers [SWA, SWA, CSA, HCA] and 16 experts,
#      seed 13, 300 positions (reported, not in CI: 3.5 GB checkpoint)
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

B_SETS=(--set vocab_size=2048 --set hidden_size=384 --set head_dim=256 --set q_lora_rank=256
        --set sliding_window=32 --set index_n_heads=2 --set index_topk=16
        --set n_routed_experts=16 --set num_experts_per_tok=4 --set moe_intermediate_size=256)
F_SETS=(--set num_hidden_layers=4 --set 'compress_ratios=[0,0,4,128,0]' --set num_hash_layers=3
        --set n_routed_experts=16)

run() {  # name n every meta mkmodel-args...
    local name=$1 n=$2 every=$3 meta=$4; shift 4
    local t0=$SECONDS
    dsv4-mkmodel "$@" --out /tmp/ck_$name || return 1
    echo "mkmodel $name: $((SECONDS - t0)) s, $(du -sh /tmp/ck_$name | cut -f1)"
    python3 tests/model/hf_reference.py --ckpt /tmp/ck_$name --n "$n" --seed 7 --every "$every" \
        --out "$OUT/hf_$name.fix" --meta "$meta"
}
if [ "${ONLY_K512:-0}" = 0 ]; then
    run tiny 640 8 '{"preset":"tiny","seed":11}' --preset tiny --seed 11
    run b 320 8 '{"preset":"small","seed":12,"sets":"B"}' --preset small --seed 12 "${B_SETS[@]}"
fi
# A and B again with index_topk=512 (>= every entry count here): the indexer's
# choice cannot differ, so everything else is compared without selection flips
run tinyk 640 8 '{"preset":"tiny","seed":11,"sets":"index_topk=512"}' --preset tiny --seed 11 \
    --set index_topk=512
run bk 320 8 '{"preset":"small","seed":12,"sets":"B,index_topk=512"}' --preset small --seed 12 \
    "${B_SETS[@]}" --set index_topk=512
if [ "${SKIP_FLASH:-0}" = 0 ]; then
    run flash4 300 32 '{"preset":"flash","seed":13,"sets":"F"}' --preset flash --seed 13 "${F_SETS[@]}"
fi
ls -la "$OUT"

# Our CPU forward on the flash-width checkpoint against a fixture made earlier
# (FLASH_FIX=path): prints the comparison (not a CI test: 3.7 GB checkpoint).
if [ -n "${FLASH_FIX:-}" ] && [ -x .carry/bin/test_hf ]; then
    [ -d /tmp/ck_flash4 ] || dsv4-mkmodel --preset flash --seed 13 "${F_SETS[@]}" --out /tmp/ck_flash4
    for num in hf ref; do
        /usr/bin/time -f "%e s %M KB" test_hf /tmp/ck_flash4 "$FLASH_FIX" $num 1 0
    done
fi
