#!/bin/sh
# The demo (make demo): check every spec in specs/, report each one's memory at Llama-3-8B dimensions
# (32 layers, 32 query heads, 8 kv heads, head_dim 128), batch 1, a 4096-token prefill; then run the papers'
# schemes on structured synthetic K/V/Q (cpu backend when this build has it, else the reference) and compare what
# they lose; time a KIVI-2 decode step on the cpu backend next to the reference (kvq bench; a clear line instead
# when the cpu backend cannot run here); last, compile one spec ahead of time with kvqc build when NVRTC is
# installed (no GPU needed).
# Usage: tools/demo.sh BUILD_DIR   (the directory holding kvqc and kvq; make demo passes it)
build=${1:-build}
case "$build" in /*) ;; *) build="$(pwd)/$build" ;; esac
kvqc="$build/kvqc"
kvq="$build/kvq"
if [ ! -x "$kvqc" ] || [ ! -x "$kvq" ]; then
    echo "demo: $kvqc or $kvq not found; run make first" >&2
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2

specs=$(ls specs/*.kvq specs/paper/*.kvq 2>/dev/null)
failed=0

echo "== kvqc check"
"$kvqc" check $specs || failed=1

dims="--layers 32 --heads 32 --kv-heads 8 --head-dim 128 --batch 1 --seq 4096"
for f in $specs; do
    echo
    echo "== kvqc report $f $dims"
    "$kvqc" report "$f" $dims || failed=1
done

echo
echo "== kvq eval: the papers' schemes on structured synthetic K/V/Q (cpu backend, else the reference)"
"$kvq" eval specs/fp16.kvq specs/kivi4.kvq specs/kivi2.kvq specs/ott.kvq specs/zipcache.kvq specs/tailorkv2.kvq \
    --synthetic --layers 2 --heads 8 --kv-heads 2 --head-dim 128 --tokens 768 --prefill 640 --seed 7 || failed=1

echo
# One decode step of one layer at Llama-3-8B's attention shape over 4096 cached tokens, cache evicted from the LLC
# before each step: how fast each backend reads it, against the read bandwidth kvq bench measures itself.
bench="specs/kivi2.kvq --tokens 4096 --heads 32 --kv-heads 8 --head-dim 128 --passes 3 -q"
echo "== kvq bench: a KIVI-2 decode step, 32 heads / 8 kv heads, head_dim 128, 4096 tokens, on the cpu backend"
cpu_ms=
if "$kvq" bench $bench --backend cpu --steps 10 >"$build/demo-bench-cpu.txt" 2>"$build/demo-bench-cpu.err"; then
    cat "$build/demo-bench-cpu.txt"
    cpu_ms=$(awk '$1 == "kivi2" { print $8 }' "$build/demo-bench-cpu.txt")
elif grep -q -e 'backend is not built into this libkvq' -e 'backend cannot run here' "$build/demo-bench-cpu.err"; then
    echo "the cpu backend cannot run here: $(grep -v 'note:' "$build/demo-bench-cpu.err" | tail -n 1 |
        sed 's/^kvq bench: [a-z0-9]*: //')"
else
    cat "$build/demo-bench-cpu.txt" "$build/demo-bench-cpu.err"
    failed=1
fi
echo
echo "== kvq bench: the same on the reference backend (plain C, one thread, the oracle)"
if "$kvq" bench $bench --backend reference --threads 1 --steps 3 >"$build/demo-bench-ref.txt"; then
    cat "$build/demo-bench-ref.txt"
    ref_ms=$(awk '$1 == "kivi2" { print $8 }' "$build/demo-bench-ref.txt")
    if [ -n "$cpu_ms" ] && [ -n "$ref_ms" ]; then
        echo "KIVI-2 decode step: cpu $cpu_ms ms, reference $ref_ms ms ($(awk -v c="$cpu_ms" -v r="$ref_ms" \
            'BEGIN { printf "%.1f", r / c }')x faster)"
    fi
else
    cat "$build/demo-bench-ref.txt"
    failed=1
fi

echo
out="$build/demo-generated"
echo "== kvqc build specs/kivi2.kvq --arch sm_80,sm_90 -o $out"
if "$kvqc" build specs/kivi2.kvq --arch sm_80,sm_90 -o "$out" >"$build/demo-build.log" 2>&1; then
    echo "wrote $out/kivi2/: $(cd "$out/kivi2" && ls | tr '\n' ' ')"
    sed -n '1,7p' "$out/kivi2/resources.txt"
else
    echo "kvqc build did not run here (NVRTC missing?): $(tail -n 1 "$build/demo-build.log")"
fi

echo
if [ "$failed" -ne 0 ]; then
    echo "demo: some steps failed (see above)"
    exit 1
fi
echo "demo: every spec checks, reports and runs"
