#!/bin/sh
# Runs every test program in BUILD/tests and every tests/sh/test_*.sh script, and totals their PASS/FAIL/SKIP
# lines. A program that crashes or exits non-zero without reporting a failure counts as one failure of its own.
# The scripts (install, Python) get PLAIN_BUILD, a build without sanitizers, as their argument.
# Passing programs show only their SKIP lines (and the Python script its pytest summary and notes), and each
# program its time in seconds.
# Last line: "N passed, N failed" (", N skipped" when a case printed SKIP).
#
# The scripts run first, one at a time (the Python one makes PLAIN_BUILD/venv, whose python3 with numpy then
# serves the unit tests that cross-check with NumPy); then the programs, KVQ_TEST_JOBS at a time (default: the
# machine's cores; the programs are single-threaded under the sanitizers, and each uses its own temporary files),
# the longest first, their results printed in name order once all have run.

# run_one PATH: runs one script or program into $out/NAME.{log,rc,secs}.
run_one() {
    name=$(basename "$1")
    t0=$(date +%s)
    case "$1" in
        *.sh) sh "$1" "$plain" >"$out/$name.log" 2>&1 ;;
        *) "$1" >"$out/$name.log" 2>&1 ;;
    esac
    echo $? >"$out/$name.rc"
    echo $(($(date +%s) - t0)) >"$out/$name.secs"
}
# `run.sh --one PATH` (with $out and $plain exported): what xargs runs for each program below.
if [ "$1" = --one ]; then
    run_one "$2"
    exit 0
fi

build=${1:-build}
plain=${2:-build}
export KVQ_SRCDIR=${KVQ_SRCDIR:-$(pwd)}
export KVQ_CACHE_DIR=${KVQ_CACHE_DIR:-$(pwd)/$build/cache}
# intercept_tls_get_addr=0: up to GCC 13 / LLVM 16 the sanitizer runtime's __tls_get_addr interceptor can take a
# dynamic TLS block (the emulator dlopens a module per scheme) for a pre-2.25 glibc header and read garbage, and
# LeakSanitizer's tracer then dies at exit ("Tracer caught signal 11"; docs/testing.md, the one-hour runs).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:intercept_tls_get_addr=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

jobs=${KVQ_TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}
pass=0; fail=0; skip=0
out=$(mktemp -d)

# report PATH: prints one result and adds it to the totals.
report() {
    name=$(basename "$1")
    log="$out/$name.log"
    rc=$(cat "$out/$name.rc" 2>/dev/null || echo 127)
    secs=$(cat "$out/$name.secs" 2>/dev/null || echo 0)
    p=$(grep -c '^PASS ' "$log"); f=$(grep -c '^FAIL ' "$log"); s=$(grep -c '^SKIP ' "$log")
    if [ "$f" -gt 0 ] || [ "$rc" -ne 0 ] || [ "${KVQ_TEST_VERBOSE:-0}" = 1 ]; then
        cat "$log"
    else
        grep -E '^(SKIP |pytest: |note: )' "$log"
    fi
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name: exited with status $rc without reporting a failure"
        f=1
    fi
    if [ "$s" -gt 0 ]; then
        echo "-- $name: $p passed, $f failed, $s skipped (${secs} s)"
    else
        echo "-- $name: $p passed, $f failed (${secs} s)"
    fi
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
}

for t in tests/sh/test_*.sh; do
    [ -f "$t" ] || continue
    run_one "$t"
    report "$t"
done
[ -x "$plain/venv/bin/python3" ] && case ":$PATH:" in *":$(pwd)/$plain/venv/bin:"*) ;;
    *) PATH="$(pwd)/$plain/venv/bin:$PATH"; export PATH ;; esac

# The programs, the ones known to take minutes under the sanitizers first so that the others fill the gaps.
progs=""
for t in "$build"/tests/test_*; do [ -f "$t" ] && [ -x "$t" ] && progs="$progs $t"; done
first="test_cuda_replay test_cpu_backend test_cuda_device test_cuda_backend test_cuda_serve test_cuda_atomic test_cuda_emu test_cuda_fakedrv"
order=""
for n in $first; do case " $progs " in *" $build/tests/$n "*) order="$order $build/tests/$n" ;; esac; done
for t in $progs; do case " $order " in *" $t "*) ;; *) order="$order $t" ;; esac; done
export out plain
printf '%s\n' $order | xargs -P "$jobs" -I{} sh "$0" --one {}
for t in $progs; do report "$t"; done
rm -rf "$out"
if [ "$skip" -gt 0 ]; then
    echo "$pass passed, $fail failed, $skip skipped"
else
    echo "$pass passed, $fail failed"
fi
[ "$fail" -eq 0 ]
