#!/bin/sh
# `make gpu-bundle` without the NVRTC pre-fill (GPU_BUNDLE_PREFILL=0: no generated cubins, no cache; the full
# bundle compiles for minutes) into a temporary folder, then the bundle's own gpu-check.sh --dry-run from there:
# the bundle holds what the GPU machine needs, its programs load without LLVM, its specs check, and every command
# the check would run on a GPU parses and stops at the missing driver. The no-LLVM objects stay in
# build/gpu-nollvm between runs (about 50 s of both cores the first time, seconds after). docs/gpu.md.
# Then the bundle's benchmark on the recording fake driver. One PASS/FAIL line per case.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
check() { # name, condition result (0 ok), message
    if [ "$2" -eq 0 ]; then echo "PASS $1"; else echo "FAIL $1: $3"; fi
}
make --no-print-directory -s gpu-bundle GPU_BUNDLE="$work/bundle" GPU_BUNDLE_PREFILL=0 >"$work/make.log" 2>&1
st=$?
check gpu_bundle_builds "$st" "$(tail -n 20 "$work/make.log")"
[ "$st" -eq 0 ] || exit 0
b="$work/bundle"
size=$(du -sb "$b" | cut -f1)
check gpu_bundle_size "$(test "$size" -le $((40 * 1024 * 1024)); echo $?)" "$size bytes, more than 40 MiB"
check gpu_bundle_files "$(test -x "$b/gpu-check.sh" -a -x "$b/bin/test_gpu_backend" -a -x "$b/bin/test_gpu_replay" \
    -a -x "$b/bin/bench_gpu_decode" -a -x "$b/bin/kvq" -a -f "$b/share/kvq/specs/kivi2.kvq" \
    -a -f "$b/share/kvq/generated/kivi2/kernels.cu" -a -f "$b/share/kvq/tests/emu/emu_cuda.h" -a -f "$b/MANIFEST" \
    -a -f "$b/ncu-step.py" -a -f "$b/cost-vs-ncu.py"; echo $?)" \
    "$(cd "$b" && find . -maxdepth 3 | sort | tr '\n' ' ')"
nollvm=0
for p in "$b"/bin/*; do ldd "$p" 2>/dev/null | grep -qi llvm && nollvm=1; done
check gpu_bundle_without_llvm "$nollvm" "a program of the bundle links libLLVM"
# from another directory, as on the GPU machine: the bundle finds everything relative to itself
# --deep --pack: every step's command, and the results as one file (results.tar.gz), the folder removed
(cd "$work" && sh "$b/gpu-check.sh" --dry-run --deep --pack --out "$work/results") >"$work/check.log" 2>&1
st=$?
[ "$st" -eq 0 ] && [ ! -d "$work/results" ] && tar -xzf "$work/results.tar.gz" -C "$work" || st=1
check gpu_check_dry_run "$st" "$(cat "$work/check.log")"
s="$work/results/summary.md"
ok=1
grep -q 'all pass' "$s" && grep -q 'without LLVM or missing libraries: yes' "$s" && grep -q '^| test_gpu_backend ' "$s" &&
    grep -q '^| memcheck ' "$s" && grep -q '^| racecheck ' "$s" && grep -q 'bench_gpu_decode --ctx 4k,32k --batch 32' "$s" &&
    grep -q '^    dry run: ncu ' "$s" && grep -q 'ncu-deep-b1.txt' "$s" && ! grep -q 'without a driver exited' "$s" && ok=0
check gpu_check_summary "$ok" "$(cat "$s" 2>/dev/null)"
# The bundle's benchmark against the recording fake driver (tests/fakecuda, built by `make gpu-bundle` beside the
# bundle's programs): its own driver calls (events, the bandwidth copy) must follow the driver's rules as the
# library's do. The first H200 run found it calling cuEventCreate with no current context (docs/gpu-results.md);
# the fake refuses that as the driver does. The figures on the fake mean nothing; the fp16 row shows the step ran.
fake=$(pwd)/build/gpu-nollvm/tests/fakecuda/libcuda.so.1
(cd "$b/share/kvq" && KVQ_LIBCUDA="$fake" FAKECUDA_VERBOSE=1 KVQ_SRCDIR="$b/share/kvq" \
    timeout 300 "$b/bin/bench_gpu_decode" --ctx 1k --batch 2 --steps 1 --warmup 1 --hbm-mib 1 specs/fp16.kvq) \
    >"$work/bench.log" 2>&1
st=$?
ok=1
[ "$st" -eq 0 ] && ! grep -q 'fakecuda: violation' "$work/bench.log" && grep -q '^| fp16 *| *2 |' "$work/bench.log" && ok=0
check gpu_bench_on_fake_driver "$ok" "exit $st: $(grep -m 5 'violation\|skipped\|rror' "$work/bench.log" | tr '\n' ' ')"
# --layers: a step of several layers, each its own cache (kvq_decode_device and the captured kvq_decode_run of
# every layer), on the fake driver: the rules hold, the header says so, and the rows report a layer's share (the
# cache bytes of one layer, as at --layers 1); a layer count out of range is refused. --profile-steps on a driver
# without cuProfilerStart (the fake) leaves the steps as they are
(cd "$b/share/kvq" && KVQ_LIBCUDA="$fake" FAKECUDA_VERBOSE=1 KVQ_SRCDIR="$b/share/kvq" \
    timeout 300 "$b/bin/bench_gpu_decode" --ctx 1k --batch 2 --steps 1 --warmup 1 --hbm-mib 0 specs/kivi2.kvq) \
    >"$work/bench1.log" 2>&1
(cd "$b/share/kvq" && KVQ_LIBCUDA="$fake" FAKECUDA_VERBOSE=1 KVQ_SRCDIR="$b/share/kvq" \
    timeout 300 "$b/bin/bench_gpu_decode" --ctx 1k --batch 2 --steps 1 --warmup 1 --hbm-mib 0 --layers 3 \
    --profile-steps specs/kivi2.kvq) >"$work/bench3.log" 2>&1
st=$?
mib() { sed -n 's/^| kivi2 *| *2 | *1k |[^|]*|[^|]*|[^|]*|[^|]*| *\([0-9.]*\) |.*/\1/p' "$1"; }
ok=1
[ "$st" -eq 0 ] && ! grep -q 'fakecuda: violation' "$work/bench3.log" && grep -q '3 layers a step' "$work/bench3.log" &&
    [ -n "$(mib "$work/bench3.log")" ] && [ "$(mib "$work/bench3.log")" = "$(mib "$work/bench1.log")" ] && ok=0
"$b/bin/bench_gpu_decode" --layers 0 >/dev/null 2>&1
[ $? -eq 2 ] || ok=1
check gpu_bench_layers "$ok" "exit $st, a layer's MiB $(mib "$work/bench3.log") against $(mib "$work/bench1.log"): $(grep -m 5 'violation\|layers\|rror' "$work/bench3.log" | tr '\n' ' ')"
