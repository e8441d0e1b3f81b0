#!/bin/sh
# tools/ncu-step.py (docs/gpu.md, gpu-check.sh's ncu-step-b1.csv) on fabricated input: ncu's raw CSV layout (banner,
# header, units row) with three steps' kernels in launch order: fp16's (append, decode, merge), KIVI-2's (append,
# a flush's quantization, decode, merge) and a one-chunk step with no merge (append, decode). Each step is cut at
# its merge or after a decode no merge follows, and its kernels' microseconds sum. Prints PASS/FAIL lines.
cd "$(dirname "$0")/../.." || exit 1
name="ncu-step: a decode step's kernels from ncu's raw CSV, cut at each merge"
if ! command -v python3 >/dev/null 2>&1; then echo "SKIP $name: no python3"; exit 0; fi
d=$(mktemp -d) || exit 1
trap 'rm -rf "$d"' EXIT
cat >"$d/step.csv" <<'C'
==PROF== Connected to process 1 (bench_gpu_decode)
"ID","Process ID","Kernel Name","Grid Size","gpu__time_duration.sum"
"","","","","nsecond"
"0","1","kvq_store_f16","(8, 1, 1)","2,500"
"1","1","kvq_decode_c0(kvq_decode_params)","(8, 47, 1)","50,112"
"2","1","kvq_merge","(32, 1, 1)","3,200"
"3","1","kvq_store_f16","(8, 1, 1)","2,400"
"4","1","kvq_quant_hi_c0","(8, 1, 1)","4,100"
"5","1","kvq_decode_c0","(8, 45, 1)","30,848"
"6","1","kvq_merge","(32, 1, 1)","3,000"
"7","1","kvq_store_f16","(8, 1, 1)","2,000"
"8","1","kvq_decode_c0","(8, 1, 1)","9,000"
C
out=$(python3 tools/ncu-step.py "$d/step.csv" 2>&1)
st=$?
fail=""
[ "$st" -eq 0 ] || fail="exit $st"
[ "$(echo "$out" | wc -l)" -eq 3 ] || fail="$fail; not 3 steps"
echo "$out" | sed -n 1p | grep -qx -- "- step 0: kvq_store_f16 2.5, kvq_decode_c0 50.1, kvq_merge 3.2; kernels 55.8 us, of them decode 50.1" ||
    fail="$fail; step 0: $(echo "$out" | sed -n 1p)"
echo "$out" | sed -n 2p | grep -qx -- "- step 1: kvq_store_f16 2.4, kvq_quant_hi_c0 4.1, kvq_decode_c0 30.8, kvq_merge 3.0; kernels 40.3 us, of them decode 30.8" ||
    fail="$fail; step 1: $(echo "$out" | sed -n 2p)"
echo "$out" | sed -n 3p | grep -qx -- "- step 2: kvq_store_f16 2.0, kvq_decode_c0 9.0; kernels 11.0 us, of them decode 9.0" ||
    fail="$fail; step 2: $(echo "$out" | sed -n 3p)"
# bad input: no header; no file
printf 'x,y\n1,2\n' >"$d/bad.csv"
python3 tools/ncu-step.py "$d/bad.csv" >/dev/null 2>&1
[ $? -eq 2 ] || fail="$fail; a CSV without the columns was accepted"
python3 tools/ncu-step.py "$d/missing.csv" >/dev/null 2>&1
[ $? -eq 2 ] || fail="$fail; a missing file was accepted"
if [ -z "$fail" ]; then echo "PASS $name"; else echo "FAIL $name: ${fail#; }"; echo "$out"; fi
