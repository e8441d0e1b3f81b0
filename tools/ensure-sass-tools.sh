#!/bin/sh
# Installs the SASS tools kvqc build's cost model uses (docs/cuda.md, "Cost model"): NVIDIA's
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels from PyPI into a virtual environment under the build
# directory (the CUDA toolkit's NVRTC does not ship them), and links them as $BUILD/sass-tools/{cuobjdump,nvdisasm}.
# Idempotent; nothing is installed system-wide. Exits 0 with a note when Python or the network is missing:
# kvqc build --cost then refuses (cuobjdump is for reading SASS by hand, as docs/cuda.md's hand counts do).
BUILD=${1:-build}
TOOLS="$BUILD/sass-tools"
[ -x "$TOOLS/cuobjdump" ] && [ -x "$TOOLS/nvdisasm" ] && exit 0
PY=$(command -v python3 || true)
if [ -z "$PY" ]; then
    echo "kvq: no python3; kvqc build --cost is unavailable" >&2
    exit 0
fi
mkdir -p "$BUILD"
if [ ! -x "$BUILD/sass-venv/bin/pip" ]; then
    "$PY" -m venv "$BUILD/sass-venv" || { echo "kvq: python3 -m venv failed; kvqc build --cost is unavailable" >&2; exit 0; }
fi
"$BUILD/sass-venv/bin/pip" install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm ||
    { echo "kvq: pip install of nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm failed; kvqc build --cost is unavailable" >&2; exit 0; }
mkdir -p "$TOOLS"
for t in cuobjdump nvdisasm; do
    f=$(find "$BUILD/sass-venv" -type f -name "$t" -perm -u+x | head -n 1)
    [ -n "$f" ] && ln -sf "$(cd "$(dirname "$f")" && pwd)/$t" "$TOOLS/$t"
done
[ -x "$TOOLS/cuobjdump" ] || echo "kvq: cuobjdump not found in the wheel (only hand counts use it)" >&2
exit 0
