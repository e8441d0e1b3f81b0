#!/bin/sh
# The Python package's tests (python/tests, pytest) in a virtualenv, BUILD/venv, made on first use from
# python/requirements-test.txt (remade when that file changes); the package itself is pip-installed from the
# checkout on every run, with the plain build's libkvq.so bundled. pytest's cases become PASS/FAIL/SKIP lines;
# pytest's own summary line is shown too. Argument: the plain (non-sanitized) build folder, default build.
build=${1:-build}
root=$(pwd)
venv="$root/$build/venv"
req="$root/python/requirements-test.txt"
stamp="$venv/.kvq-requirements-$(cksum <"$req" | cut -d' ' -f1)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if [ ! -f "$build/libkvq.so.0" ]; then
    echo "FAIL python: $build/libkvq.so.0 is not built (make)"
    exit 1
fi
if [ ! -f "$stamp" ]; then
    rm -rf "$venv"
    start=$(date +%s)
    if ! python3 -m venv "$venv" >"$log" 2>&1; then
        echo "SKIP python: python3 -m venv failed (install python3-venv): $(tail -1 "$log")"
        exit 0
    fi
    "$venv/bin/pip" install -q --upgrade pip >/dev/null 2>&1
    if ! "$venv/bin/pip" install -q numpy pytest matplotlib >"$log" 2>&1; then
        echo "SKIP python: pip could not install numpy/pytest (no package index?): $(tail -1 "$log")"
        rm -rf "$venv"
        exit 0
    fi
    # torch and transformers: without them the model tests print SKIP (pytest.importorskip) and the rest runs.
    if ! "$venv/bin/pip" install -q -r "$req" >"$log" 2>&1; then
        echo "note: pip could not install torch/transformers; their tests will be skipped: $(tail -1 "$log")"
    else
        touch "$stamp"
    fi
    echo "note: virtualenv $venv made in $(( $(date +%s) - start )) s, $(du -sm "$venv" | cut -f1) MiB"
fi
if ! "$venv/bin/pip" install -q --no-deps --force-reinstall "$root/python" >"$log" 2>&1; then
    echo "FAIL python_install: pip install python/ failed:"
    cat "$log"
    exit 1
fi
echo "PASS python_install"
# From outside the checkout, so `import kvq` is the installed package (and its bundled library).
cd "$(mktemp -d)" || exit 1
KVQ_SRCDIR="$root" KVQ_BUILD="$root/$build" "$venv/bin/python" -m pytest -rA -q -p no:cacheprovider \
    "$root/python/tests" >"$log" 2>&1
rc=$?
cd "$root" || exit 1
# The short summary: "PASSED file::name", "FAILED file::name - why", "SKIPPED [n] file:line: why", "ERROR ...".
sed -n -e 's/^PASSED [^ ]*::\([^ ]*\).*/PASS \1/p' -e 's/^FAILED [^ ]*::\([^ ]*\)\(.*\)/FAIL \1\2/p' \
    -e 's/^ERROR [^ ]*::\([^ ]*\)\(.*\)/FAIL \1 (error)\2/p' -e 's/^SKIPPED \[[0-9]*\] \(.*\)/SKIP \1/p' "$log"
summary=$(grep -E '^=*.* (passed|failed|skipped|error|no tests ran).* in [0-9.]+s' "$log" | tail -1)
echo "pytest: ${summary:-no summary line}"
case $rc in
    0) ;;
    1) grep -q '^FAIL' "$log" || true; sed -n '/^=* FAILURES =*/,/^=* short test summary/p' "$log" | head -150 ;;
    5) echo "FAIL python_tests: pytest collected no tests" ;;
    *) echo "FAIL python_tests: pytest exited with status $rc"; tail -40 "$log" ;;
esac
exit 0
