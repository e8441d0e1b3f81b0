#!/bin/sh
# Runs every test program in BUILD/tests and every tests/sh/test_*.sh script, and totals their PASS/FAIL/SKIP
# lines. A program that crashes or exits non-zero without reporting a failure counts as one failure of its own.
# The scripts (install, Python) get PLAIN_BUILD, a build without sanitizers, as their argument.
# Passing programs show only their SKIP lines (and the Python script its pytest summary and notes).
# Last line: "N passed, N failed" (", N skipped" when a case printed SKIP).
build=${1:-build}
plain=${2:-build}
export KVQ_SRCDIR=${KVQ_SRCDIR:-$(pwd)}
export KVQ_CACHE_DIR=${KVQ_CACHE_DIR:-$(pwd)/$build/cache}
# intercept_tls_get_addr=0: up to GCC 13 / LLVM 16 the sanitizer runtime's __tls_get_addr interceptor can take a
# dynamic TLS block (the emulator dlopens a module per scheme) for a pre-2.25 glibc header and read garbage, and
# LeakSanitizer's tracer then dies at exit ("Tracer caught signal 11"; docs/testing.md, the one-hour runs).
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:intercept_tls_get_addr=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
pass=0; fail=0; skip=0
log=$(mktemp)
# The scripts first: the Python one makes PLAIN_BUILD/venv, whose python3 (with numpy) then serves the unit
# tests that cross-check with NumPy.
for t in tests/sh/test_*.sh "$build"/tests/test_*; do
    [ -f "$t" ] || continue
    [ -x "$plain/venv/bin/python3" ] && case ":$PATH:" in *":$(pwd)/$plain/venv/bin:"*) ;;
        *) PATH="$(pwd)/$plain/venv/bin:$PATH"; export PATH ;; esac
    name=$(basename "$t")
    t0=$(date +%s)
    case "$t" in
        *.sh) sh "$t" "$plain" >"$log" 2>&1 ;;
        *) [ -x "$t" ] || continue; "$t" >"$log" 2>&1 ;;
    esac
    rc=$?
    secs=$(($(date +%s) - t0))
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
done
rm -f "$log"
if [ "$skip" -gt 0 ]; then
    echo "$pass passed, $fail failed, $skip skipped"
else
    echo "$pass passed, $fail failed"
fi
[ "$fail" -eq 0 ]
