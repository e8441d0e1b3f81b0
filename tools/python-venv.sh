#!/bin/sh
# Makes BUILD/venv for the Python tests from python/requirements-test.txt, unless it is already there for this
# requirements file (a stamp names its checksum). `make test` runs this in the background while the C code
# compiles (the download and unpacking of torch are most of the time); tests/sh/test_python.sh runs it too, so
# it also works alone. Prints one line saying what it did; exit 0 unless even numpy/pytest could not be had.
build=${1:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/$build/venv"
req="$root/python/requirements-test.txt"
stamp="$venv/.kvq-requirements-$(cksum <"$req" | cut -d' ' -f1)"
[ -f "$stamp" ] && exit 0
log="$root/$build/venv.log"
mkdir -p "$root/$build"
rm -rf "$venv"
start=$(date +%s)
if ! python3 -m venv "$venv" >"$log" 2>&1; then
    echo "python-venv: python3 -m venv failed (install python3-venv): $(tail -1 "$log")"
    rm -rf "$venv"
    exit 1
fi
"$venv/bin/pip" install -q --upgrade pip >>"$log" 2>&1
if ! "$venv/bin/pip" install -q numpy pytest matplotlib >>"$log" 2>&1; then
    echo "python-venv: pip could not install numpy/pytest (no package index?): $(tail -1 "$log")"
    rm -rf "$venv"
    exit 1
fi
# torch and transformers: without them the model tests print SKIP (pytest.importorskip) and the rest runs; no
# stamp, so the next run tries again.
if ! "$venv/bin/pip" install -q -r "$req" >>"$log" 2>&1; then
    echo "python-venv: pip could not install torch/transformers, their tests will be skipped: $(tail -1 "$log")"
    exit 0
fi
touch "$stamp"
echo "python-venv: $venv made in $(( $(date +%s) - start )) s, $(du -sm "$venv" | cut -f1) MiB"
