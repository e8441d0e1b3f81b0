#!/bin/sh
# The Python package's tests (python/tests, pytest) in a virtualenv, BUILD/venv, made by tools/python-venv.sh
# from python/requirements-test.txt (remade when that file changes); the package itself is pip-installed from the
# checkout on every run, with the plain build's libkvq.so bundled. pytest's cases become PASS/FAIL/SKIP lines;
# pytest's own summary line is shown too. Argument: the plain (non-sanitized) build folder, default build.
build=${1:-build}
root=$(pwd)
venv="$root/$build/venv"
log=$(mktemp)
work=$(mktemp -d)
trap 'rm -rf "$log" "$work"' EXIT
if [ ! -f "$build/libkvq.so.0" ]; then
    echo "FAIL python: $build/libkvq.so.0 is not built (make)"
    exit 1
fi
made=$(sh tools/python-venv.sh "$build")
[ -n "$made" ] && echo "note: $made"
if [ ! -x "$venv/bin/python" ]; then
    echo "SKIP python: no virtualenv for the Python tests ($made)"
    exit 0
fi
if ! "$venv/bin/pip" install -q --no-deps --force-reinstall "$root/python" >"$log" 2>&1; then
    echo "FAIL python_install: pip install python/ failed:"
    cat "$log"
    exit 1
fi
echo "PASS python_install"
if "$venv/bin/kvq-dump" --help >/dev/null 2>&1 && "$venv/bin/kvq-ppl" --help >/dev/null 2>&1; then
    echo "PASS console_scripts"
else
    echo "FAIL console_scripts: kvq-dump --help or kvq-ppl --help failed"
fi
# From outside the checkout, so `import kvq` is the installed package (and its bundled library).
cd "$work" || exit 1
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
