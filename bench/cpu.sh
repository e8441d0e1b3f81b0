#!/bin/sh
# The CPU decode tables of docs/bench.md: kvq bench of KIVI-2, KIVI-4 and fp16 (specs/), head_dim 128, 8 kv heads,
# batch 1, 8 and 32 query heads, on the cpu backend (T = 16k and 64k, 1 and 2 threads) and on the reference
# backend (single-threaded, and only at small T: it takes about a second a step at 64k). Writes markdown to
# stdout: the machine (lscpu's model, cores, LLC), the date, then one table per backend, each with the read
# bandwidth kvq bench measured in the same run. Progress goes to stderr.
#
# Usage: bench/cpu.sh [BUILD_DIR] > table.md     (make bench-cpu runs it; BUILD_DIR holds kvq, default build)
# Environment (defaults): BACKENDS ("cpu reference"), TOKENS (16384,65536), THREADS (1,2), STEPS (20),
#   REF_TOKENS (4096,16384), REF_STEPS (5), HEADS (8,32), BENCH_OPTS (extra kvq bench options, e.g. --pin).
build=${1:-build}
case "$build" in /*) ;; *) build="$(pwd)/$build" ;; esac
kvq="$build/kvq"
if [ ! -x "$kvq" ]; then
    echo "bench/cpu.sh: $kvq not found; run make first" >&2
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2

BACKENDS=${BACKENDS:-cpu reference}
TOKENS=${TOKENS:-16384,65536}
THREADS=${THREADS:-1,2}
STEPS=${STEPS:-20}
REF_TOKENS=${REF_TOKENS:-4096,16384}
REF_STEPS=${REF_STEPS:-5}
HEADS=${HEADS:-8,32}
BENCH_OPTS=${BENCH_OPTS:-}

lscpu_field() { lscpu 2>/dev/null | sed -n "s/^$1:[[:space:]]*//p" | head -n 1; }
model=$(lscpu_field 'Model name')
cpus=$(lscpu_field 'CPU(s)')
cores=$(lscpu_field 'Core(s) per socket')
sockets=$(lscpu_field 'Socket(s)')
l3=$(lscpu_field 'L3 cache')

load=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)
echo "### Machine: ${model:-unknown} — ${cpus:-?} CPUs (${cores:-?} cores per socket, ${sockets:-?} socket(s)), L3 ${l3:-unknown}; $(date -u '+%Y-%m-%d %H:%M UTC'); load average ${load:-unknown} at the start"
echo

status=0
for be in $BACKENDS; do
    if [ "$be" = reference ]; then
        tokens=$REF_TOKENS threads=1 steps=$REF_STEPS
        note="The reference backend is plain single-threaded C (the oracle), so it runs with one thread and only at small T; its figures are the baseline the cpu backend is measured against, not a target."
    else
        tokens=$TOKENS threads=$THREADS steps=$STEPS
        note=""
    fi
    # A backend that cannot run here (the cpu backend without LLVM) gets one line, not a table of errors.
    if ! why=$("$kvq" bench specs/fp16.kvq --backend "$be" --tokens 16 --heads 8 --kv-heads 8 --head-dim 128 \
               --steps 1 --warmup 0 --passes 1 --threads 1 --warm -q 2>&1 >/dev/null); then
        echo "#### Backend $be: not run here"
        echo
        echo "\`kvq bench --backend $be\` cannot run here: $(printf '%s\n' "$why" | grep -v '^kvq bench: note:' |
            tail -n 1 | sed 's/^kvq bench: fp16: //')"
        echo
        continue
    fi
    echo "#### Backend $be"
    echo
    [ -n "$note" ] && { echo "$note"; echo; }
    echo "bench/cpu.sh: $be: T = $tokens, heads $HEADS, threads $threads, $steps steps" >&2
    # shellcheck disable=SC2086
    "$kvq" bench specs/fp16.kvq specs/kivi2.kvq specs/kivi4.kvq --backend "$be" --tokens "$tokens" --heads "$HEADS" \
        --kv-heads 8 --head-dim 128 --batch 1 --threads "$threads" --steps "$steps" --markdown $BENCH_OPTS || status=1
    echo
done
exit $status
