#!/bin/sh
# tools/cost-vs-ncu.py (docs/cuda.md, "Cost model") on fabricated input: a kvqc --cost block list of four blocks
# and an ncu source-page CSV of the same instructions' addresses (absolute, with ncu's banner, a quoted header, a
# block that never ran and a NOP after it; stall samples with their no-instruction part). The loop block is 40 in the model and 30 measured (one of its instructions 31: the
# spread a wrong block boundary would show). Prints PASS/FAIL lines (tests/run.sh).
cd "$(dirname "$0")/../.." || exit 1
name="cost-vs-ncu: totals and the block that differs most, from a fabricated ncu source CSV"
if ! command -v python3 >/dev/null 2>&1; then echo "SKIP $name: no python3"; exit 0; fi
d=$(mktemp -d) || exit 1
trap 'rm -rf "$d"' EXIT
cat >"$d/model.txt" <<'M'
loc 4: 10
block 0 ins 0..2 n 3 reach 1 count 4 est 4 addr 0..20 [10:4] [11:4]
block 1 ins 3..4 n 2 reach 1 count 40 est 40 addr 30..40 [20:40]
block 2 ins 5..5 n 1 reach 1 count 4 est 4 addr 50..50 [40:4]
block 3 ins 6..6 n 1 reach 0 count 0 est 0 addr 60..60 [41:0]
M
cat >"$d/ncu.csv" <<'C'
==PROF== Connected to process 1 (bench_gpu_decode)
"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed","L1 Wavefronts Shared Excessive","L1 Wavefronts Shared","stall_no_inst"
"0x7f1200000000","MOV R1, c[0x0][0x28]","3","4","128","0","0","2"
"0x7f1200000010","S2R R0, SR_TID.X","1","4","128","0","0","0"
"0x7f1200000020","@P0 BRA 0x7f1200000050","0","4","128","0","0","0"
"0x7f1200000030","LDS.128 R4, [R2]","9","30","960","90","120","1"
"0x7f1200000040","@!P1 BRA 0x7f1200000030","2","31","992","0","0","0"
"0x7f1200000050","EXIT","0","4","128","0","0","0"
"0x7f1200000060","MOV R9, R9","0","0","0","0","0","0"
"0x7f1200000070","NOP","0","0","0","0","0","0"
C
out=$(python3 tools/cost-vs-ncu.py "$d/ncu.csv" "$d/model.txt" --top 5 2>&1)
st=$?
fail=""
[ "$st" -eq 0 ] || fail="exit $st"
echo "$out" | grep -q "^model 96 warp-instructions, measured 77 (ncu), model / measured 1.247" || fail="$fail; totals"
# the code run: 6 of the 7 instructions that are not NOPs (the MOV after the exit never ran), 3 of 15 samples
# stalled for an instruction
echo "$out" | sed -n '2p' | grep -q "^code executed: 6 of 7 instructions (0.1 KiB); no-instruction stalls: 3 of 15 samples (20.0 %)$" ||
    fail="$fail; code line '$(echo "$out" | sed -n '2p')'"
# the first row after the header: block 1, model 40, measured 30.5 a run of its instructions, spread 30..31
row=$(echo "$out" | sed -n '4p')
echo "$row" | grep -Eq '^ +1 +30\.\.40 +2 +40 +30 +80 +61 30\.\.31$' || fail="$fail; block row '$row'"
# --conflicts: the shared-memory totals and the instruction with the excess wavefronts, its block and lines
out2=$(python3 tools/cost-vs-ncu.py "$d/ncu.csv" "$d/model.txt" --top 0 --conflicts 3 2>&1)
echo "$out2" | grep -q "^shared memory: 120 wavefronts, 90 of them excess (75.0 %)" || fail="$fail; conflict totals"
echo "$out2" | grep -Eq '^ +30 +90 +30 +4\.0 +1  LDS\.128 R4, \[R2\] +20$' || fail="$fail; conflict row: $out2"
[ "$(echo "$out2" | wc -l)" -eq 6 ] || fail="$fail; instructions without excess listed" # totals, code, 2 headers, 1 row
python3 tools/cost-vs-ncu.py "$d/ncu.csv" "$d/model.txt" --conflicts x >/dev/null 2>&1
[ $? -eq 2 ] || fail="$fail; --conflicts x was accepted"
# bad input: no block lines
python3 tools/cost-vs-ncu.py "$d/ncu.csv" "$d/ncu.csv" >/dev/null 2>&1
[ $? -eq 2 ] || fail="$fail; a model list without blocks was accepted"
if [ -z "$fail" ]; then echo "PASS $name"; else echo "FAIL $name: ${fail#; }"; echo "$out"; fi
