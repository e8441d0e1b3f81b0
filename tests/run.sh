#!/bin/sh
# Runs every test program in BUILD/tests and every tests/sh/test_*.sh script, and totals their PASS/FAIL/SKIP
# lines. A program that crashes or exits non-zero without reporting a failure counts as one failure of its own.
# The scripts (install, Python) get PLAIN_BUILD, a build without sanitizers, as their argument.
# Passing programs show only their SKIP lines (and the Python script its pytest summary and notes), and each
# program its time in seconds.
# Before it, every skip's reason with its count. Under CI=true a skip is a failure, except a GPU test's on a
# machine without a GPU (its reason says "no GPU"): CI must not pass with a backend left untested.
# Last line: "N passed, N failed" (", N skipped" when a case printed SKIP).
#
# The scripts and the programs run KVQ_TEST_JOBS at a time (default: the machine's cores; the programs are
# single-threaded under the sanitizers, and each uses its own temporary files), the longest first, their results
# printed (scripts first, then programs in name order) once all have run. Only when PLAIN_BUILD/venv is missing
# does the Python script run first, alone: it makes the virtualenv whose python3 with numpy serves the unit tests
# that cross-check with NumPy. $KVQ_NVRTC_HELPER (unless set already): PLAIN_BUILD/tests/nvrtc-helper, which
# compiles the programs' CUDA units outside the sanitizers (runtime/cuda/cu_nvrtc.c); $KVQ_LLVM_HELPER likewise
# PLAIN_BUILD/tests/llvm-helper, their cpu modules (compiler/emit_llvm_jit.c).
# Which is longest: tests/test-times, one line per program, `NAME SECONDS [shards=N] [emu=HOW]` (measured under
# the sanitizers, cold cache). A program not listed counts 60 s if it is an emulator program (test_cuda_*), else 0.
# shards=N (N > 1) runs the program N times at once with KVQ_TEST_SHARD=K/N (K = 0..N-1): the program runs its
# units of work K, K + N, ... only (it must read KVQ_TEST_SHARD; tests/harness.h th_shard_mine), so that one long
# program does not hold a core after the others are done; its shards report as one program. emu=plain runs it with
# KVQ_EMU_SANITIZE=0: its emulated kernels uninstrumented (runtime/cuda/cu_emu.c), libkvq still under the
# sanitizers, for programs that test the host side and whose kernels other programs run under ASan; emu=address
# with KVQ_EMU_SANITIZE=address: the kernels under ASan without UBSan (about twice as fast), memory checks kept.
# opt=FLAG (KVQ_EMU_OPT, default -O1): the emulated modules' optimisation; -Og compiles a module under ASan + UBSan
# about 3 times faster, for programs whose time is the compiles rather than the kernels' runs. res=0
# (KVQ_EMU_RESOURCES=0): the emulator loads units without NVRTC's register and static shared memory figures (no
# NVRTC compile a unit), for programs that test their kernels' results or the host side, not the launch checks:
# test_cuda_nvrtc compiles every shipped spec with NVRTC, test_cuda_emu loads them with the checks.

# run_one PATH[@K/N]: runs one script or program (shard K of N) into $out/NAME[@K].{log,rc,secs}.
run_one() {
    path=${1%@*}
    name=$(basename "$path")
    tag=$name
    shard=
    case "$1" in *@*) shard=${1##*@}; tag="$name@${shard%/*}" ;; esac
    t0=$(date +%s)
    case "$path" in
        *.sh) sh "$path" "$plain" >"$out/$tag.log" 2>&1 ;;
        *) (case "$(hint_of "$name" emu)" in
                plain) KVQ_EMU_SANITIZE=0; export KVQ_EMU_SANITIZE ;;
                address) KVQ_EMU_SANITIZE=address; export KVQ_EMU_SANITIZE ;;
            esac
            [ "$(hint_of "$name" res)" = 0 ] && { KVQ_EMU_RESOURCES=0; export KVQ_EMU_RESOURCES; }
            opt=$(hint_of "$name" opt)
            if [ -n "$opt" ]; then KVQ_EMU_OPT=$opt; export KVQ_EMU_OPT; fi
            if [ -n "$shard" ]; then KVQ_TEST_SHARD=$shard; export KVQ_TEST_SHARD; fi
            exec "$path") >"$out/$tag.log" 2>&1 ;;
    esac
    echo $? >"$out/$tag.rc"
    echo $(($(date +%s) - t0)) >"$out/$tag.secs"
}
# hint_of NAME KEY: the program's KEY=VALUE in tests/test-times (empty when it has none).
hint_of() {
    awk -v n="$1" -v k="$2" '$1 == n { for (i = 3; i <= NF; i++) if (index($i, k "=") == 1) print substr($i, length(k) + 2) }' \
        "$KVQ_SRCDIR/tests/test-times" 2>/dev/null
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

# shards_of NAME: how many shards tests/test-times gives the program (1 when it names none).
shards_of() {
    n=$(hint_of "$1" shards)
    [ "${n:-1}" -gt 1 ] 2>/dev/null && echo "$n" || echo 1
}

# report PATH: prints one result and adds it to the totals.
report() {
    name=$(basename "$1")
    log="$out/$name.log"
    rc=$(cat "$out/$name.rc" 2>/dev/null || echo 127)
    secs=$(cat "$out/$name.secs" 2>/dev/null || echo 0)
    n=$(shards_of "$name")
    if [ "$n" -gt 1 ]; then
        # a sharded program: its shards' logs in shard order, the worst status, the longest shard's seconds
        : >"$log"; rc=0; secs=0; each=""
        k=0
        while [ "$k" -lt "$n" ]; do
            cat "$out/$name@$k.log" >>"$log" 2>/dev/null
            r=$(cat "$out/$name@$k.rc" 2>/dev/null || echo 127); [ "$r" -ne 0 ] && rc=$r
            t=$(cat "$out/$name@$k.secs" 2>/dev/null || echo 0); [ "$t" -gt "$secs" ] && secs=$t
            each="$each${each:++}$t"
            k=$((k + 1))
        done
        secs="$secs s in $n shards: $each"
    else
        secs="$secs s"
    fi
    p=$(grep -c '^PASS ' "$log"); f=$(grep -c '^FAIL ' "$log"); s=$(grep -c '^SKIP ' "$log")
    # Every skip, with its program, for the summary at the end.
    grep '^SKIP ' "$log" | sed "s|^SKIP |$name: |" >>"$out/skips"
    # Under CI a skip is a failure unless it is the one skip a CI machine may have: a GPU test without a GPU
    # (its reason says "no GPU"). A backend this machine can build but did not is not tested, and CI must say so.
    ci_bad=0
    [ "${CI:-}" = true ] && ci_bad=$(grep '^SKIP ' "$log" | grep -vc 'no GPU')
    if [ "$f" -gt 0 ] || [ "$rc" -ne 0 ] || [ "${KVQ_TEST_VERBOSE:-0}" = 1 ]; then
        cat "$log"
    else
        grep -E '^(SKIP |pytest: |note: )' "$log"
    fi
    if [ "$ci_bad" -gt 0 ]; then
        grep '^SKIP ' "$log" | grep -v 'no GPU' | sed 's/^SKIP /FAIL (CI=true: a skip is a failure here) /'
        f=$((f + ci_bad)); s=$((s - ci_bad))
    fi
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $name: exited with status $rc without reporting a failure"
        f=1
    fi
    if [ "$s" -gt 0 ]; then
        echo "-- $name: $p passed, $f failed, $s skipped ($secs)"
    else
        echo "-- $name: $p passed, $f failed ($secs)"
    fi
    pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
}

# The scripts join the programs' queue when the Python tests' virtualenv is already there (make test makes it
# while it builds); without it test_python.sh runs first, alone, and makes it for the programs that use numpy.
scripts=""
for t in tests/sh/test_*.sh; do
    [ -f "$t" ] || continue
    if [ "$t" = tests/sh/test_python.sh ] && [ ! -x "$plain/venv/bin/python3" ]; then
        run_one "$t"
        report "$t"
        continue
    fi
    scripts="$scripts $t"
done
[ -x "$plain/venv/bin/python3" ] && case ":$PATH:" in *":$(pwd)/$plain/venv/bin:"*) ;;
    *) PATH="$(pwd)/$plain/venv/bin:$PATH"; export PATH ;; esac
# NVRTC outside the sanitizers: the plain build's helper compiles each CUDA unit a sanitized program needs into the
# shared cache (runtime/cuda/cu_nvrtc.c; about 1.8 times faster than NVRTC under ASan's allocator).
if [ -z "${KVQ_NVRTC_HELPER+set}" ] && [ -x "$plain/tests/nvrtc-helper" ]; then
    KVQ_NVRTC_HELPER=$(cd "$plain/tests" && pwd)/nvrtc-helper
    export KVQ_NVRTC_HELPER
fi
# LLVM likewise: the helper optimises and compiles each cpu module into the cache (compiler/emit_llvm_jit.c).
if [ -z "${KVQ_LLVM_HELPER+set}" ] && [ -x "$plain/tests/llvm-helper" ]; then
    KVQ_LLVM_HELPER=$(cd "$plain/tests" && pwd)/llvm-helper
    export KVQ_LLVM_HELPER
fi

# The programs, the ones known to take minutes under the sanitizers first (a shard counts its share) so that
# the others fill the gaps.
progs=""
for t in "$build"/tests/test_*; do [ -f "$t" ] && [ -x "$t" ] && progs="$progs $t"; done
order=$(for t in $scripts $progs; do
    name=$(basename "$t")
    secs=$(awk -v n="$name" '$1 == n { print $2 }' "$KVQ_SRCDIR/tests/test-times" 2>/dev/null)
    n=$(shards_of "$name")
    [ -z "$secs" ] && case "$name" in test_cuda_*) secs=60 ;; *) secs=0 ;; esac
    if [ "$n" -gt 1 ]; then
        k=0
        while [ "$k" -lt "$n" ]; do echo "$((secs / n)) $t@$k/$n"; k=$((k + 1)); done
    else
        echo "$secs $t"
    fi
done | sort -k1,1nr -s | cut -d' ' -f2)
export out plain
printf '%s\n' $order | xargs -P "$jobs" -I{} sh "$0" --one {}
for t in $scripts $progs; do report "$t"; done
if [ -s "$out/skips" ]; then
    echo "Skipped ($(wc -l <"$out/skips")), by reason:"
    # Reasons grouped: a case's own name differs, its reason (after the last ': ') is what repeats.
    sed 's/.*: //' "$out/skips" | sort | uniq -c | sort -rn | sed 's/^ */  /'
fi
rm -rf "$out"
if [ "$skip" -gt 0 ]; then
    echo "$pass passed, $fail failed, $skip skipped"
else
    echo "$pass passed, $fail failed"
fi
[ "$fail" -eq 0 ]
