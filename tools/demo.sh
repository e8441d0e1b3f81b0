#!/bin/sh
# The demo (make demo): check every spec in specs/, report each one's memory at Llama-3-8B dimensions
# (32 layers, 32 query heads, 8 kv heads, head_dim 128), batch 1, a 4096-token prefill; then run the papers'
# schemes on structured synthetic K/V/Q with the reference (CPU) backend and compare what they lose; last,
# compile one spec ahead of time with kvqc build when NVRTC is installed (no GPU needed).
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
echo "== kvq eval: the papers' schemes on structured synthetic K/V/Q (reference backend, CPU)"
"$kvq" eval specs/fp16.kvq specs/kivi4.kvq specs/kivi2.kvq specs/ott.kvq specs/zipcache.kvq specs/tailorkv2.kvq \
    --synthetic --layers 2 --heads 8 --kv-heads 2 --head-dim 128 --tokens 768 --prefill 640 --seed 7 || failed=1

echo
echo "== the cpu backend (LLVM-compiled kernels) next to the reference: KIVI-2 decode, 8 kv heads, head_dim 128,"
echo "   4096 tokens, one thread (build/bench/bench_cpu_decode; docs/cpu.md)"
bench="$build/bench/bench_cpu_decode"
if [ -x "$bench" ] && "$bench" specs/kivi2.kvq 4096 1 1 9 cpu >"$build/demo-cpu.log" 2>&1; then
    cat "$build/demo-cpu.log"
    "$bench" specs/kivi2.kvq 4096 1 1 3 reference || failed=1
else
    echo "the cpu backend did not run here: $(tail -n 1 "$build/demo-cpu.log" 2>/dev/null)"
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
