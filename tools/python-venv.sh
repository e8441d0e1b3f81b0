#!/bin/sh
# Makes BUILD/venv for the Python tests from python/requirements-test.txt, unless it is already there for this
# requirements file (a stamp names its checksum). `make test` runs this in the background while the C code
# compiles (the download and unpacking of torch are most of the time); tests/sh/test_python.sh runs it too, so
# it also works alone. Prints one line saying what it did; exit 0 unless even numpy/pytest could not be had.
#
# The packages are installed with uv (from PyPI, like pip): it downloads and unpacks in parallel, which halves
# the time of torch's 3 GB of CUDA wheels on a cold cache (docs/python.md, "Tests and what they cost CI"), and it
# can leave triton out (1 GB installed; only torch.compile uses it, never a CPU forward). Without uv, pip does it
# all, triton included.
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
py="$venv/bin/python"
overrides="$venv/.kvq-overrides.txt"
echo 'triton; sys_platform == "never"' >"$overrides"
use_pip() {
    installer="pip ($1)"
    install() { "$venv/bin/pip" install -q "$@"; }
}
if "$venv/bin/pip" install -q uv >>"$log" 2>&1; then
    installer="uv"
    install() { "$venv/bin/uv" pip install -q --python "$py" --override "$overrides" "$@"; }
    # uv reaches the index its own way (its TLS roots, no pip.conf): where it cannot, pip does the rest.
    install numpy pytest matplotlib >>"$log" 2>&1 || use_pip "uv could not install numpy"
else
    use_pip "uv could not be installed"
fi
if ! install numpy pytest matplotlib >>"$log" 2>&1; then
    echo "python-venv: $installer could not install numpy/pytest (no package index?): $(tail -1 "$log")"
    rm -rf "$venv"
    exit 1
fi
# torch and transformers: without them the model tests print SKIP (pytest.importorskip) and the rest runs; no
# stamp, so the next run tries again.
if ! install -r "$req" >>"$log" 2>&1; then
    echo "python-venv: $installer could not install torch/transformers, their tests will be skipped: $(tail -1 "$log")"
    exit 0
fi
touch "$stamp"
echo "python-venv: $venv made with $installer in $(( $(date +%s) - start )) s, $(du -sm "$venv" | cut -f1) MiB"
