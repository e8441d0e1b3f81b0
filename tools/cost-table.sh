#!/bin/sh
# Issue 22's cost table (docs/cuda.md, "Cost model"): kvqc build --cost for KIVI-2, KIVI-4 and fp16 at head_dim 128,
# GQA 4 (32 / 8 heads) and GQA 1 (8 / 8), sm_80 and sm_90, batch 1 and 32, TOKENS prefilled tokens a sequence
# (default 32768), printed as one table with the targets met or not. Each build goes to OUT/<scheme>-gqa<g>
# (default /tmp/costgen), its log beside it; a build whose profiles are there already only maps them again.
# Slow: one emulated decode step a row (minutes each). Run from the source directory after `make build/kvqc`.
set -e
tokens=${1:-32768}
out=${2:-/tmp/costgen}
kvqc=${KVQC:-build/kvqc}
mkdir -p "$out"
first=1
for spec in kivi2 kivi4 fp16; do
    for g in 4 1; do
        dims=""
        [ "$g" = 1 ] && dims="--heads 8 --kv-heads 8"
        dir="$out/$spec-gqa$g"
        # shellcheck disable=SC2086
        if ! "$kvqc" build "specs/$spec.kvq" --arch sm_90,sm_80 -o "$dir" $dims --cost --cost-tokens "$tokens" \
            --cost-batch 1,32 >"$dir.log" 2>&1; then
            cat "$dir.log" >&2
            exit 1
        fi
        awk -v s="$spec" -v first="$first" '
            /^#/ { if (first == 1) print; next }
            /^kernel/ { if (first == 1) printf "%-6s %s\n", "scheme", $0; next }
            NF > 0 { printf "%-6s %s\n", s, $0 }' "$dir/$spec/cost.txt"
        first=0
    done
done
