#!/bin/sh
# kvq's device check (docs/gpu.md): runs from the GPU bundle (`make gpu-bundle`) on a machine with an NVIDIA GPU,
# the driver, libnvrtc, compute-sanitizer and ncu; no compiler, LLVM or network needed. Each step runs under a
# timeout (tests 100 s each, sanitizers 50 s each, benchmark 60 s each, ncu 45 s each, ncu's per-instruction counts
# 30 s each and at GQA 1: 630 s in all), all within
# --budget seconds (default 480: 8 minutes), and writes into a results folder:
#   env.txt           the card, driver, CUDA, the bundle's MANIFEST
#   tests/*.log       the GPU tests: every spec against the reference backend on the GPU (test_gpu_backend),
#                     planned steps replayed as CUDA graphs (test_gpu_replay), and any other bin/test_gpu_*
#   memcheck.log, racecheck.log   compute-sanitizer on a bounded subset (the benchmark at 1k tokens: KIVI-2, OTT,
#                     ZipCache, TailorKV's sparse retrieval, fp16; 2 timed steps each)
#   bench-b1.md, bench-b32.md     the decode benchmark by CUDA events, cold L2: fp16, KIVI-2, KIVI-4 at 4k and 32k
#                     tokens, batch 1 and 32, with the HBM bandwidth measured in the same run
#   ncu-b1.csv, ncu-b32.csv  Nsight Compute on the decode kernel (32k tokens, batch 1 and 32): DRAM throughput,
#                     achieved occupancy, issue-slot use, executed warp-instructions per token per kv head (the
#                     cost model's unit), shared-memory bank conflicts
#   ncu-step-b1.csv   every kernel of one eager decode step a scheme (32k tokens, batch 1; ncu-step-b32.csv:
#                     batch 32) with its time (tools/ncu-step.py): what the step spends beside the decode kernel
#   ncu-pc-<scheme>.csv (and .ncu-rep)  Nsight Compute's executed warp-instructions per SASS instruction of
#                     kvq_decode_c0 (fp16, KIVI-2, KIVI-4; 32k tokens, batch 1): tools/cost-vs-ncu.py compares them
#                     block by block with the cost model
#   summary.md        all of it in one page, printed at the end (paste into docs/gpu-results.md)
#   with --deep, after those (each within what is left of the budget):
#   bench-128k.md     the benchmark at 128k tokens, batch 1 (fp16, KIVI-2, KIVI-4)
#   bench-layers.md   batch 1 at 32k tokens, 32 layers a step run back to back (a layer's share): the kernels' code
#                     stays in L2 from one layer to the next, as in a model's decode (one layer a step flushes it)
#   bench-policies.md OTT, TailorKV (dense and sparse retrieval) and ZipCache at 32k tokens, batch 8
#   ncu-deep.txt      Nsight Compute's speed-of-light, memory, warp-state (stall reasons), scheduler and occupancy
#                     sections on the same decode kernels
#   --pack            at the end, the results folder packed as DIR.tar.gz and removed (one file to carry back:
#                     the device tool returns a bounded number of files, and run 4 lost its 40)
# Usage: ./gpu-check.sh [--dry-run] [--deep] [--pack] [--out DIR] [--budget SECONDS]
# --dry-run does everything but the GPU steps: checks the bundle (files, that every binary loads without LLVM,
# kvq and kvqc run, every spec checks) and writes the summary with the commands it would run. CI runs it
# (tests/sh/test_gpu_bundle.sh). Exit status: 0 when every step that ran passed, 1 otherwise.
set -u
here=$(cd "$(dirname "$0")" && pwd)
dry=0
deep=0
pack=0
out=""
budget=480
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --deep) deep=1 ;;
        --pack) pack=1 ;;
        --out) out=$2; shift ;;
        --budget) budget=$2; shift ;;
        *) echo "usage: $0 [--dry-run] [--deep] [--pack] [--out DIR] [--budget SECONDS]" >&2; exit 2 ;;
    esac
    shift
done
[ -n "$out" ] || out="$here/results-$(date -u +%Y%m%d-%H%M%S)"
mkdir -p "$out/tests" || exit 2
out=$(cd "$out" && pwd)
bin="$here/bin"
# the toolkit's profilers are often installed off the PATH (CUDA images put ncu under /opt/nvidia/nsight-compute)
for d in /usr/local/cuda/bin /opt/nvidia/nsight-compute/*; do
    [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH="$PATH:$d" ;; esac
done
export PATH
share="$here/share/kvq"
export KVQ_SRCDIR="$share"
export KVQ_CACHE_DIR="$here/cache"
# the NVRTC cache the bundle pre-filled travels packed (tools/gpu-bundle.sh); unpacked once, here
if [ ! -d "$here/cache" ] && [ -f "$here/cache.tar.gz" ]; then tar -C "$here" -xzf "$here/cache.tar.gz" || exit 2; fi
mkdir -p "$here/cache"
start=$(date +%s)
status=0
sum="$out/summary.md"
: >"$sum"
note() { echo "$*" >>"$sum"; }

# left SECS: the timeout for a step that wants SECS, within what is left of the budget (10 s kept for the end).
left() {
    rem=$((budget - ($(date +%s) - start) - 10))
    [ "$rem" -lt 1 ] && rem=1
    [ "$1" -lt "$rem" ] && echo "$1" || echo "$rem"
}
# step NAME SECS LOG CMD...: runs CMD (from share/kvq, where the specs are) under a timeout, output to LOG;
# sets rc (124: timed out). In a dry run it only records the command.
step() {
    name=$1 secs=$(left "$2") log=$3
    shift 3
    if [ "$dry" = 1 ]; then
        # the program itself (past a compute-sanitizer or ncu in front), with no driver: it must parse the
        # command line and stop at the device with "skipped" (SKIP), exit 0
        echo "dry run: $*" >"$log"
        while [ $# -gt 0 ] && [ "${1#"$bin"/}" = "$1" ]; do shift; done
        (cd "$share" && KVQ_LIBCUDA=/nonexistent/libcuda.so.1 timeout -k 5 30 "$@") >"$log.dry" 2>&1
        rc=$?
        if [ "$rc" -ne 0 ] || ! grep -q '^skipped\|^SKIP' "$log.dry"; then
            note "dry run: \`$(basename "$1")\` without a driver exited $rc: $(head -c 300 "$log.dry" | tr '\n' ' ')"
            rc=1
        fi
        return
    fi
    t0=$(date +%s)
    (cd "$share" && timeout -k 5 "$secs" "$@") >"$log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - t0)) s (limit $secs s)" >>"$out/steps.txt"
}
have() { command -v "$1" >/dev/null 2>&1; }

# ---- 0. the bundle and the machine ----
missing=""
for f in MANIFEST bin/kvq bin/kvqc bin/bench_gpu_decode bin/test_gpu_backend bin/test_gpu_replay \
    share/kvq/specs/fp16.kvq share/kvq/specs/kivi2.kvq share/kvq/specs/kivi4.kvq share/kvq/generated; do
    [ -e "$here/$f" ] || missing="$missing $f"
done
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "host: $(uname -srm)"
    if have nvidia-smi; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory,pcie.link.gen.max --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
        nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/cuda driver api: \1/p'
    else
        echo "gpu: nvidia-smi not found"
    fi
    for t in compute-sanitizer ncu nvcc python3; do
        if have $t; then echo "$t: $(command -v $t) $($t --version 2>/dev/null | grep -io 'version[^,]*' | head -n 1)"; else echo "$t: not found"; fi
    done
    echo "glibc: $(ldd --version 2>/dev/null | head -n 1)"
    echo "---- MANIFEST"
    cat "$here/MANIFEST" 2>/dev/null
} >"$out/env.txt" 2>&1
gpu=$(sed -n 's/^gpu: //p' "$out/env.txt" | head -n 1)
note "## kvq GPU check: ${gpu:-no GPU found}"
note ""
note "$(sed -n 's/^date: /Date: /p' "$out/env.txt"). Bundle: $(sed -n 's/^commit: //p' "$here/MANIFEST" 2>/dev/null); $(sed -n 's/^nvrtc cache: /NVRTC cache: /p' "$here/MANIFEST" 2>/dev/null)."
[ "$dry" = 1 ] && note "" && note "**Dry run**: the bundle was checked; no GPU step ran (their commands are listed)."
note ""
if [ -n "$missing" ]; then
    note "Bundle incomplete, missing:$missing"
    status=1
fi
# every program loads (no libLLVM, no missing library) and the tools run; every spec checks
ldd_bad=""
for b in "$bin"/*; do
    l=$(ldd "$b" 2>&1)
    if echo "$l" | grep -q "not found\|LLVM"; then ldd_bad="$ldd_bad $(basename "$b")"; fi
done
ver=$("$bin/kvq" --version 2>&1)
checks=0 check_fail=""
for f in "$share"/specs/*.kvq "$share"/specs/paper/*.kvq; do
    checks=$((checks + 1))
    "$bin/kvqc" check "$f" >/dev/null 2>&1 || check_fail="$check_fail $(basename "$f")"
done
note "### Bundle"
note "- programs load without LLVM or missing libraries: $([ -z "$ldd_bad" ] && echo yes || echo "NO:$ldd_bad")"
note "- $ver; kvqc check of $checks specs: $([ -z "$check_fail" ] && echo "all pass" || echo "FAILED:$check_fail")"
[ -z "$ldd_bad" ] && [ -z "$check_fail" ] && case "$ver" in kvq*) ;; *) false ;; esac || status=1
note ""

# ---- 1. the GPU tests ----
note "### GPU tests (every spec against the reference backend, on the GPU)"
note "| program | passed | failed | skipped | exit | seconds |"
note "|---|---|---|---|---|---|"
for t in "$bin"/test_gpu_*; do
    n=$(basename "$t")
    t0=$(date +%s)
    step "$n" 100 "$out/tests/$n.log" "$t"
    p=$(grep -c '^PASS ' "$out/tests/$n.log") f=$(grep -c '^FAIL ' "$out/tests/$n.log") s=$(grep -c '^SKIP \|^skipped' "$out/tests/$n.log")
    note "| $n | $p | $f | $s | $([ "$dry" = 1 ] && echo "dry run ($rc)" || { [ $rc = 124 ] && echo timeout || echo $rc; }) | $(($(date +%s) - t0)) |"
    [ "$f" -gt 0 ] || [ "$rc" -ne 0 ] && status=1
done
note ""

# ---- 2. compute-sanitizer on a bounded subset ----
subset="--ctx 1k --batch 2 --steps 2 --warmup 1 --hbm-mib 0 specs/kivi2.kvq specs/ott.kvq specs/zipcache.kvq tailorkv2-sparse"
note "### compute-sanitizer (decode benchmark at 1k tokens, batch 2, 2 steps: fp16, KIVI-2, OTT, ZipCache, TailorKV sparse)"
note "| tool | errors reported | exit |"
note "|---|---|---|"
for tool in memcheck racecheck; do
    if [ "$dry" = 0 ] && ! have compute-sanitizer; then
        note "| $tool | - | compute-sanitizer not found |"
        continue
    fi
    # shellcheck disable=SC2086
    step "$tool" 50 "$out/$tool.log" compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
        "$bin/bench_gpu_decode" $subset
    errs=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p; s/.*RACECHECK SUMMARY: \([0-9]*\) hazard.*/\1/p' "$out/$tool.log" | tail -n 1)
    note "| $tool | ${errs:--} | $([ "$dry" = 1 ] && echo "dry run ($rc)" || { [ $rc = 124 ] && echo timeout || echo $rc; }) |"
    [ "$rc" -ne 0 ] && status=1
done
note ""

# ---- 3. the decode benchmark by events ----
note "### Decode benchmark (CUDA events, cold L2; one layer, 32 heads / 8 kv heads, head_dim 128)"
for b in 1 32; do
    steps=20
    [ "$b" = 32 ] && steps=10
    step "bench-b$b" 60 "$out/bench-b$b.md" "$bin/bench_gpu_decode" --ctx 4k,32k --batch "$b" --steps "$steps"
    note ""
    if [ "$dry" = 1 ]; then note "    $(cat "$out/bench-b$b.md")"; else sed -n '/^kvq GPU decode/,$p' "$out/bench-b$b.md" >>"$sum"; fi
    [ "$rc" -ne 0 ] && status=1 && note "(exit $rc$([ $rc = 124 ] && echo ': timed out'))"
done
# The tile and occupancy knobs (docs/cuda.md "Tuning knobs"): the plan's 256-token tiles pay the per-tile work half
# as often (KIVI-2 51.9 -> 44.1 warp-instructions a token at 32k by the cost model) at 3 CTAs an SM where 128-token
# tiles allow 4; only the GPU can say which is faster.
step bench-tune 90 "$out/bench-tune.md" "$bin/bench_gpu_decode" --ctx 32k --batch 1 --steps 10 --hbm-mib 0 \
    --tune 0/0,0/0/128,4/0/128 specs/kivi2.kvq specs/kivi4.kvq
note ""
note "The tuning knobs at 32k tokens, batch 1 (rows 'm<MINB> w<WAVES> [t<TILE>]', exit $rc):"
note ""
[ "$dry" = 1 ] || sed -n '/^kvq GPU decode/,$p' "$out/bench-tune.md" >>"$sum"
[ "$rc" -ne 0 ] && status=1
note ""

# ---- 4. Nsight Compute on the decode kernel ----
# Executed warp-instructions (smsp__inst_executed) per token per kv head are what the cost model counts (docs/cuda.md
# "Cost model", kvqc build --cost): the rows check it against the machine. --no-graph: one decode launch a scheme.
metrics="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum.per_second,\
sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,\
smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__registers_per_thread,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
note "### Nsight Compute: the decode kernel (kvq_decode_c*), 32k tokens, 32 heads / 8 kv heads (launch order: fp16, KIVI-2, KIVI-4)"
if [ "$dry" = 0 ] && ! have ncu; then
    note "ncu not found"
else
    for b in 1 32; do
        # --clock-control none: measure the card at the clocks it runs at (ncu would lock them to base otherwise)
        step "ncu-b$b" 45 "$out/ncu-b$b.log" ncu --clock-control none --csv --page raw --log-file "$out/ncu-b$b.csv" \
            --kernel-name regex:kvq_decode_c --launch-count 3 --metrics "$metrics" \
            "$bin/bench_gpu_decode" --ctx 32k --batch "$b" --steps 1 --warmup 0 --hbm-mib 0 --no-graph
        note ""
        note "Batch $b:"
        note ""
        if [ "$dry" = 1 ]; then
            note "    $(cat "$out/ncu-b$b.log")"
        elif [ -s "$out/ncu-b$b.csv" ] && have python3; then
            python3 - "$out/ncu-b$b.csv" $((32768 * 8 * b)) >>"$sum" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
tokheads = float(sys.argv[2])  # tokens x kv heads x batch the kernel attends over
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if head is None:
    print("no kernel rows (see the ncu log)"); sys.exit(0)
h = rows[head]
col = lambda r, name: r[h.index(name)] if name in h and h.index(name) < len(r) else "?"
print("| # | kernel | grid | regs | us | DRAM % peak | DRAM GB/s | achieved occupancy % | issue slots busy % | warp-instr executed | per token per kv head | smem ld conflicts / wavefronts | smem st conflicts / wavefronts |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for i, r in enumerate(rows[head + 2:]):
    if len(r) < len(h) // 2: continue
    num = lambda n: col(r, n).replace(",", "")
    try: us = "%.1f" % (float(num("gpu__time_duration.sum")) / 1e3)
    except ValueError: us = num("gpu__time_duration.sum")
    try: per = "%.1f" % (float(num("smsp__inst_executed.sum")) / tokheads)
    except ValueError: per = "?"
    print("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s | %s / %s |" % (
        i, col(r, "Kernel Name")[:40], col(r, "Grid Size"), num("launch__registers_per_thread"), us,
        num("dram__throughput.avg.pct_of_peak_sustained_elapsed"), num("dram__bytes_read.sum.per_second"),
        num("sm__warps_active.avg.pct_of_peak_sustained_active"), num("sm__inst_issued.avg.pct_of_peak_sustained_active"),
        num("smsp__inst_executed.sum"), per,
        num("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"), num("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"),
        num("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"), num("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum")))
print("\n(units as ncu reports them: DRAM GB/s in its unit row; time from gpu__time_duration)")
EOF
        else
            note "ncu wrote no table (exit $rc): $(grep -m 3 -i 'error\|permission' "$out/ncu-b$b.log" | tr '\n' ' ')"
        fi
        [ "$rc" -ne 0 ] && status=1
    done
fi
note ""

# ---- 4a. every kernel of a decode step, batches 1 and 32 ----
# At batch 1 the decode kernel was about half of a layer's step (docs/gpu-results.md run 8: KIVI-2's kernel 30 of
# the 59 us a layer takes in a 32-layer graph), and at batch 32 KIVI-2's graph step took 876 us around a 701-us
# kernel (run 7): the step's other kernels (the inputs, the new token's stores and quantizations, flushes, the
# merge) and the gaps between them are the rest. ncu times the kernels of one eager step a scheme after a warm-up
# step (--profile-steps opens the profiler's range around the timed steps only; --profile-from-start off), and
# tools/ncu-step.py lists each step's kernels.
for B in 1 32; do
    note "### Nsight Compute: every kernel of one decode step, 32k tokens, batch $B (fp16, KIVI-2, KIVI-4)"
    note ""
    if [ "$dry" = 0 ] && ! have ncu; then
        note "ncu not found"
    else
        step ncu-step-b$B 90 "$out/ncu-step-b$B.log" ncu --clock-control none --profile-from-start off --csv \
            --page raw --log-file "$out/ncu-step-b$B.csv" --metrics gpu__time_duration.sum "$bin/bench_gpu_decode" \
            --ctx 32k --batch $B --steps 1 --warmup 1 --hbm-mib 0 --no-graph --profile-steps
        if [ "$dry" = 1 ]; then
            note "    $(cat "$out/ncu-step-b$B.log")"
        elif [ -s "$out/ncu-step-b$B.csv" ] && have python3; then
            python3 "$here/ncu-step.py" "$out/ncu-step-b$B.csv" >>"$sum" 2>&1
        else
            note "ncu wrote no table (exit $rc): $(grep -m 3 -i 'error\|permission' "$out/ncu-step-b$B.log" | tr '\n' ' ')"
        fi
        [ "$rc" -ne 0 ] && status=1
    fi
    note ""
done

# ---- 4b. per-instruction executions of the decode kernel (the cost model's check, block by block) ----
# ncu's SourceCounters at 32k tokens, batch 1: each SASS instruction's executed warp-instructions, for kvq_decode_c0
# of fp16, KIVI-2 and KIVI-4 (the benchmark's launch order; one launch each), exported as CSV (the source page,
# SASS). Compared here with kvqc build --cost's block list by tools/cost-vs-ncu.py (docs/cuda.md, "Cost model").
note "### Nsight Compute: executed warp-instructions per SASS instruction, kvq_decode_c0, 32k tokens, batch 1"
note ""
if [ "$dry" = 0 ] && ! have ncu; then
    note "ncu not found"
else
    i=0
    for s in fp16 kivi2 kivi4; do
        step "ncu-pc-$s" 30 "$out/ncu-pc-$s.log" ncu --clock-control none --kernel-name kvq_decode_c0 --launch-skip $i \
            --launch-count 1 --section SourceCounters -f -o "$out/ncu-pc-$s" \
            "$bin/bench_gpu_decode" --ctx 32k --batch 1 --steps 1 --warmup 0 --hbm-mib 0 --no-graph
        [ "$rc" -ne 0 ] && status=1
        if [ "$dry" = 1 ]; then
            note "    ncu -i $out/ncu-pc-$s.ncu-rep --page source --print-source sass --csv > $out/ncu-pc-$s.csv"
        elif [ -s "$out/ncu-pc-$s.ncu-rep" ]; then
            timeout -k 5 "$(left 20)" ncu -i "$out/ncu-pc-$s.ncu-rep" --page source --print-source sass --csv \
                >"$out/ncu-pc-$s.csv" 2>>"$out/ncu-pc-$s.log" || status=1
        fi
        note "- $s: exit $rc, $(wc -l <"$out/ncu-pc-$s.csv" 2>/dev/null || echo 0) CSV lines (ncu-pc-$s.csv; the report ncu-pc-$s.ncu-rep)"
        # the kernel's shared-memory bank conflicts, instruction by instruction (docs/cuda.md "Bank conflicts")
        if [ "$dry" = 0 ] && [ -s "$out/ncu-pc-$s.csv" ] && have python3 && [ -f "$here/cost-vs-ncu.py" ]; then
            note ""
            note '```'
            python3 "$here/cost-vs-ncu.py" "$out/ncu-pc-$s.csv" - --conflicts 8 >>"$sum" 2>&1
            note '```'
        fi
        i=$((i + 1))
    done
    # GQA 1 (8 heads / 8 kv heads): the KIVI kernels' fp32 paths, which the model counted 4x lower before its fix
    step ncu-gqa1 30 "$out/ncu-gqa1.log" ncu --clock-control none --csv --page raw --log-file "$out/ncu-gqa1.csv" \
        --kernel-name kvq_decode_c0 --launch-count 3 \
        --metrics smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread \
        "$bin/bench_gpu_decode" --ctx 32k --batch 1 --heads 8 --kv-heads 8 --steps 1 --warmup 0 --hbm-mib 0 --no-graph
    [ "$rc" -ne 0 ] && status=1
    note "- GQA 1, launch order fp16, KIVI-2, KIVI-4: exit $rc (ncu-gqa1.csv)"
    if [ "$dry" = 0 ] && [ -s "$out/ncu-gqa1.csv" ] && have python3; then
        python3 - "$out/ncu-gqa1.csv" >>"$sum" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if head is not None:
    h = rows[head]
    for r in rows[head + 2:]:
        if len(r) < len(h) // 2: continue
        v = lambda n: r[h.index(n)].replace(",", "") if n in h else "?"
        try: per = "%.1f" % (float(v("smsp__inst_executed.sum")) / (32768 * 8))
        except ValueError: per = "?"
        print("  - grid %s, %s registers: %s warp-instructions, %s per token per kv head" % (
            v("launch__grid_size"), v("launch__registers_per_thread"), v("smsp__inst_executed.sum"), per))
EOF
    fi
fi
note ""

# ---- 5. with --deep: longer contexts, the policy schemes, ncu's stall reasons ----
if [ "$deep" = 1 ]; then
    note "### Deeper (--deep)"
    step bench-128k 70 "$out/bench-128k.md" "$bin/bench_gpu_decode" --ctx 128k --batch 1 --steps 10 --hbm-mib 0
    note ""
    note "Batch 1 at 128k tokens (exit $rc):"
    note ""
    [ "$dry" = 1 ] || sed -n '/^kvq GPU decode/,$p' "$out/bench-128k.md" >>"$sum"
    [ "$rc" -ne 0 ] && status=1
    step bench-layers 60 "$out/bench-layers.md" "$bin/bench_gpu_decode" --ctx 32k --batch 1 --steps 10 --hbm-mib 0 \
        --layers 32
    note ""
    note "Batch 1 at 32k tokens, 32 layers a step, a layer's share (exit $rc):"
    note ""
    [ "$dry" = 1 ] || sed -n '/^kvq GPU decode/,$p' "$out/bench-layers.md" >>"$sum"
    [ "$rc" -ne 0 ] && status=1
    step bench-policies 90 "$out/bench-policies.md" "$bin/bench_gpu_decode" --ctx 32k --batch 8 --steps 10 --hbm-mib 0 \
        specs/ott.kvq specs/tailorkv2.kvq tailorkv2-sparse specs/zipcache.kvq
    note ""
    note "The policy schemes at 32k tokens, batch 8 (exit $rc):"
    note ""
    [ "$dry" = 1 ] || sed -n '/^kvq GPU decode/,$p' "$out/bench-policies.md" >>"$sum"
    [ "$rc" -ne 0 ] && status=1
    if [ "$dry" = 1 ] || have ncu; then
        # batch 1: the latency-bound case (run 4 needed a call of its own for it)
        step ncu-deep-b1 45 "$out/ncu-deep-b1.txt" ncu --clock-control none --kernel-name regex:kvq_decode_c \
            --launch-count 3 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
            --section Occupancy --section LaunchStats \
            "$bin/bench_gpu_decode" --ctx 32k --batch 1 --steps 1 --warmup 0 --hbm-mib 0 --no-graph
        note ""
        note "ncu sections on the decode kernels at batch 1: ncu-deep-b1.txt (exit $rc)"
        [ "$rc" -ne 0 ] && status=1
        step ncu-deep 80 "$out/ncu-deep.txt" ncu --clock-control none --kernel-name regex:kvq_decode_c --launch-count 6 \
            --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
            --section Occupancy --section LaunchStats \
            "$bin/bench_gpu_decode" --ctx 32k --batch 32 --steps 1 --warmup 0 --hbm-mib 0
        note ""
        note "ncu sections on the decode kernels: ncu-deep.txt (exit $rc)"
        [ "$rc" -ne 0 ] && status=1
    fi
    note ""
fi
note "Results: $out (steps.txt has each step's exit and time); total $(($(date +%s) - start)) s of a $budget s budget."
if [ "$pack" = 1 ]; then
    if tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"; then
        cat "$sum"
        echo "packed: $out.tar.gz"
        rm -rf "$out"
        exit $status
    fi
    echo "gpu-check: packing $out failed; the folder stays" >&2
    status=1
fi
cat "$sum"
exit $status
