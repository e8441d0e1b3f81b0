#!/bin/sh
# Several builds of the decode benchmark for one GPU machine (`make gpu-ab`, docs/gpu.md "Same machine, several
# builds"): a kernel change is judged against its base on the same card in the same call, since calls on
# different machines (or minutes apart) move the graph figures by up to 10 % (docs/gpu-results.md, run 7).
#   tools/gpu-ab.sh OUT NAME=REV [NAME=REV ...]
# REV: a git revision, or "." for the checkout's files as they are (committed or not, untracked ones that git does
# not ignore included). Each build is its source exported into OUT/src/NAME, built without LLVM
# (bench/bench_gpu_decode and the recording fake driver), the benchmark stripped into OUT/NAME/ with its specs and
# its NVRTC cache filled here through the fake driver for GPU_AB_ARCH (default sm_90: H100 and H200) with the
# units of fp16 and GPU_AB_SPECS (default specs/kivi2.kvq specs/kivi4.kvq). OUT/ab.sh (tools/gpu-ab-run.sh) runs
# them on the GPU machine. GPU_AB_KEEP=1 keeps OUT/src.
set -u
usage="usage: tools/gpu-ab.sh OUT NAME=REV [NAME=REV ...]"
out=${1:?$usage}
shift
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
arch=${GPU_AB_ARCH:-sm_90}
specs=${GPU_AB_SPECS:-specs/kivi2.kvq specs/kivi4.kvq}
die() { echo "gpu-ab: $*" >&2; exit 1; }
top=$(git rev-parse --show-toplevel 2>/dev/null) || die "not in a git checkout"
cd "$top" || exit 1

# the names first: a bad one fails before minutes of building
names=""
for b in "$@"; do
    name=${b%%=*} rev=${b#*=}
    case "$b" in *=*) ;; *) die "'$b' is not NAME=REV" ;; esac
    case "$name" in '' | *[!A-Za-z0-9_.-]*) die "build name '$name': letters, digits, '.', '_', '-' only" ;; esac
    case " $names " in *" $name "*) die "build name '$name' given twice" ;; esac
    [ "$rev" = . ] || git rev-parse --verify -q "$rev^{commit}" >/dev/null || die "$name: '$rev' is not a revision"
    names="$names $name"
done

rm -rf "$out"
mkdir -p "$out/src" || die "cannot make $out"
out=$(cd "$out" && pwd)
manifest="$out/MANIFEST"
{
    echo "kvq GPU A/B: $(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -m); arch $arch; specs: fp16 $specs"
} >"$manifest"
for b in "$@"; do
    name=${b%%=*} rev=${b#*=}
    src="$out/src/$name"
    mkdir -p "$src" "$out/$name/cache" || die "cannot make $src"
    if [ "$rev" = . ]; then
        desc="the checkout at $(git rev-parse --short HEAD)$(git diff --quiet HEAD 2>/dev/null || echo ' with changes')"
        git ls-files -z -co --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src" || die "$name: export"
    else
        desc="$(git rev-parse --short "$rev^{commit}") ($rev)"
        git archive "$rev^{commit}" | tar -xf - -C "$src" || die "$name: git archive $rev"
    fi
    echo "gpu-ab: building $name: $desc" >&2
    # the no-LLVM build as the bundle's (CI unset: cpu.mk refuses a build without LLVM under CI=true)
    make -C "$src" --no-print-directory BUILD=build/gpu-nollvm SAN=0 LLVM_CONFIG= CI= \
        build/gpu-nollvm/bench/bench_gpu_decode build/gpu-nollvm/tests/fakecuda/libcuda.so.1 >"$out/$name/build.log" 2>&1 ||
        die "$name: the build failed (last lines of $out/$name/build.log): $(tail -n 5 "$out/$name/build.log")"
    strip --strip-debug -o "$out/$name/bench_gpu_decode" "$src/build/gpu-nollvm/bench/bench_gpu_decode" ||
        die "$name: strip"
    cp -R "$src/specs" "$out/$name/specs" || die "$name: specs"
    # the NVRTC cache, each unit compiled as on that arch (the fake runs no kernel); the GPU machine then finds
    # every unit there (KVQ_GENERATED_DIR points nowhere: generated/ cubins belong to one revision only)
    # shellcheck disable=SC2086
    (cd "$out/$name" && KVQ_LIBCUDA="$src/build/gpu-nollvm/tests/fakecuda/libcuda.so.1" FAKECUDA_ARCH=$arch \
        KVQ_CACHE_DIR="$out/$name/cache" KVQ_SRCDIR="$src" KVQ_GENERATED_DIR=/nonexistent \
        timeout 1200 ./bench_gpu_decode --compile-only $specs) >"$out/$name/fill.log" 2>&1 ||
        die "$name: filling the NVRTC cache failed: $(tail -n 3 "$out/$name/fill.log")"
    rm -rf "$out/$name/cache/tmp"
    echo "$name: $desc; cache $(find "$out/$name/cache" -type f | wc -l) files" >>"$manifest"
done
[ "${GPU_AB_KEEP:-0}" = 1 ] || rm -rf "$out/src"
echo "$names" | tr ' ' '\n' | sed '/^$/d' >"$out/BUILDS"
echo "$specs" >"$out/SPECS"
cp tools/gpu-ab-run.sh "$out/ab.sh" && chmod +x "$out/ab.sh" || die "copy tools/gpu-ab-run.sh"
echo "gpu-ab: $out ($(du -sh "$out" | cut -f1)); on the GPU machine: $out/ab.sh [--batch32] [--rounds N] --out DIR"
