#!/bin/sh
# Assembles the GPU bundle (tools/gpu-bundle.mk, docs/gpu.md) from binaries built without LLVM.
#   tools/gpu-bundle.sh BUILD OUT [PREFILL]
# BUILD: the no-LLVM build folder (kvq, kvqc, gpu/test_*, bench/bench_gpu_decode, tests/fakecuda/libcuda.so.1).
# OUT: the bundle folder, made afresh. PREFILL 1 (default): generated/'s cubins for sm_80 and sm_90 (kvqc build,
# NVRTC) and the NVRTC cache filled for both archs by running the GPU tests against the recording fake driver
# (it reports FAKECUDA_ARCH; the engines compile their units as they would on that GPU, the fake runs no kernel,
# so the tests' verdicts are ignored here). PREFILL 0: neither (the dry-run test; the GPU machine then compiles at
# run time, a few seconds per unit). Fails when the folder exceeds 40 MiB or a binary needs libLLVM.
set -u
build=${1:?usage: tools/gpu-bundle.sh BUILD OUT [PREFILL]}
out=${2:?usage: tools/gpu-bundle.sh BUILD OUT [PREFILL]}
prefill=${3:-1}
limit=$((40 * 1024 * 1024))
die() { echo "gpu-bundle: $*" >&2; exit 1; }

rm -rf "$out"
mkdir -p "$out/bin" "$out/share/kvq/tests/emu" "$out/share/kvq/templates" "$out/cache" || die "cannot make $out"
out=$(cd "$out" && pwd) # absolute: the pre-fill runs from inside it
bins="$build/kvq $build/kvqc $build/bench/bench_gpu_decode $(ls "$build"/gpu/test_* 2>/dev/null | grep -v '\.d$')"
for b in $bins; do
    [ -x "$b" ] || die "$b is missing (make gpu-bundle builds it)"
    # debug info off: the bundle's size; symbols stay (backtraces, compute-sanitizer's host frames)
    strip --strip-debug -o "$out/bin/$(basename "$b")" "$b" 2>/dev/null || cp "$b" "$out/bin/" || die "copy $b"
done
for b in "$out"/bin/*; do
    if ldd "$b" 2>/dev/null | grep -qi llvm; then die "$b links LLVM (build it with LLVM_CONFIG= empty)"; fi
done
# What the runtime and the programs read at run time (kvq_data_dir: share/kvq beside bin/, as `make install`).
cp -R specs "$out/share/kvq/" && cp -R generated "$out/share/kvq/" && cp templates/*.cuh "$out/share/kvq/templates/" ||
    die "copy of the data"
for f in exec.c warp.c cp_async.c fiber.c emu.h emu_abi.h emu_internal.h fiber.h emu_cuda.h emu_half.h; do
    cp "tests/emu/$f" "$out/share/kvq/tests/emu/" || die "copy tests/emu/$f"
done
find "$out/share/kvq/generated" \( -name '*.cubin' -o -name '*.ptx' -o -name '*.fatbin' -o -name 'cpu-*.o' \
    -o -name cpu.json \) -exec rm -f {} +
cp tools/gpu-check.sh "$out/gpu-check.sh" && chmod +x "$out/gpu-check.sh" || die "copy gpu-check.sh"
cp tools/cost-vs-ncu.py "$out/cost-vs-ncu.py" || die "copy cost-vs-ncu.py" # the summary's bank conflicts
cp tools/ncu-step.py "$out/ncu-step.py" || die "copy ncu-step.py"             # the summary's step kernels
cp docs/gpu.md "$out/README.md" || die "copy docs/gpu.md"

cubins=0 prefilled="none"
if [ "$prefill" = 1 ]; then
    # generated/<scheme>/sm_{80,90}.cubin: what engines of the units' model (the benchmark's) load directly
    for f in specs/*.kvq specs/paper/*.kvq; do
        KVQ_CACHE_DIR="$out/cache" "$out/bin/kvqc" build "$f" --arch sm_80,sm_90 -o "$out/share/kvq/generated" \
            >/dev/null 2>"$out/kvqc.err" || die "kvqc build $f: $(cat "$out/kvqc.err")"
    done
    rm -f "$out/kvqc.err"
    find "$out/share/kvq/generated" -name '*.ptx' -exec rm -f {} + # the cubins are what loads; PTX is JIT's fallback
    cubins=$(find "$out/share/kvq/generated" -name '*.cubin' | wc -l)
    fake="$build/tests/fakecuda/libcuda.so.1"
    [ -f "$fake" ] || die "$fake is missing (the recording fake driver, tests/fakecuda)"
    fake=$(cd "$(dirname "$fake")" && pwd)/libcuda.so.1
    # the GPU tests' engines, and the benchmark's (gpu-check.sh's schemes), each compiled as on that sm
    for arch in sm_90 sm_80; do
        for t in "$out"/bin/test_gpu_*; do
            KVQ_LIBCUDA="$fake" FAKECUDA_ARCH=$arch KVQ_CACHE_DIR="$out/cache" KVQ_SRCDIR="$out/share/kvq" \
                timeout 1200 "$t" >/dev/null 2>&1 || true # verdicts and crashes on the fake are not the point
        done
        # each engine compiles its unit into the cache and loads it (the fake answers the parameter-layout check);
        # the benchmark's steps do nothing on the fake, and their figures are meaningless here
        (cd "$out/share/kvq" && KVQ_LIBCUDA="$fake" FAKECUDA_ARCH=$arch KVQ_CACHE_DIR="$out/cache" \
            KVQ_SRCDIR="$out/share/kvq" timeout 600 "$out/bin/bench_gpu_decode" --compile-only specs/kivi2.kvq \
            specs/kivi4.kvq specs/ott.kvq specs/zipcache.kvq tailorkv2-sparse >/dev/null 2>&1)
    done
    prefilled="sm_90 sm_80 (the GPU tests' and the benchmark's units, through the fake driver)"
fi
rm -rf "$out/cache/tmp" 2>/dev/null
n_cache=$(find "$out/cache" -type f | wc -l)
# The cache's entries hold cubin, PTX and ptxas log (about 1 MB a unit, 54 MB for the two archs): packed as
# cache.tar.gz (about a quarter), which gpu-check.sh unpacks into cache/ on the GPU machine.
if [ "$n_cache" -gt 0 ]; then
    tar -C "$out" -czf "$out/cache.tar.gz" cache || die "packing the cache"
fi
rm -rf "$out/cache"
glibc=$(for b in "$out"/bin/*; do objdump -T "$b" 2>/dev/null; done | grep -o 'GLIBC_[0-9.]*' | sort -t. -k2,2n -k3,3n -u | tail -n 1)
size=$(du -sb "$out" | cut -f1)
{
    echo "kvq GPU bundle"
    echo "version: $(sed -n 's/^#define KVQ_VERSION "\(.*\)"/\1/p' runtime/include/kvq.h)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m), $(ldd --version 2>/dev/null | head -n 1)"
    echo "needs: glibc with ${glibc:-GLIBC_2.17} or newer, an NVIDIA driver (libcuda.so.1) and libnvrtc (CUDA 12 or 13)"
    echo "nvrtc here: $(ls /usr/local/cuda/lib64/libnvrtc.so.* 2>/dev/null | head -n 1 | sed 's|.*/||')"
    echo "generated cubins: $cubins"
    echo "nvrtc cache: $n_cache files, pre-filled for: $prefilled"
    echo "size: $size bytes"
} >"$out/MANIFEST"
[ "$size" -le "$limit" ] || die "$out is $size bytes, more than 40 MiB"
echo "gpu-bundle: $out ($(du -sh "$out" | cut -f1)); see $out/MANIFEST"
