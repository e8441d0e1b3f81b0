#!/bin/sh
# make install into a fresh prefix, then build a host program the way a user does (pkg-config, the installed
# header and libkvq.so only) and run a spec with it, from outside the checkout and without KVQ_SRCDIR, so the
# installed library must find its data (templates, emulator sources) beside itself. Needs the plain build
# (argument: its folder, default build). One PASS/FAIL/SKIP line per case.
build=${1:-build}
src=$(pwd)
prefix=$(mktemp -d)
work=$(mktemp -d)
trap 'rm -rf "$prefix" "$work"' EXIT
unset KVQ_SRCDIR
check() { # name, condition result (0 ok), message
    if [ "$2" -eq 0 ]; then echo "PASS $1"; else echo "FAIL $1: $3"; fi
}
if ! command -v pkg-config >/dev/null 2>&1; then
    echo "SKIP install: pkg-config is not installed (tools/ensure-deps.sh installs it)"
    exit 0
fi
make --no-print-directory -s BUILD="$build" SAN=0 install PREFIX="$prefix" >"$work/install.log" 2>&1
check install_files "$(test -f "$prefix/include/kvq.h" -a -f "$prefix/lib/libkvq.a" -a -L "$prefix/lib/libkvq.so" \
    -a -x "$prefix/bin/kvq" -a -x "$prefix/bin/kvqc" -a -f "$prefix/lib/pkgconfig/kvq.pc" \
    -a -f "$prefix/share/kvq/templates/kvq_decode.cuh"; echo $?)" "$(cat "$work/install.log")"
soname=$(readelf -d "$prefix/lib/libkvq.so" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
check soname "$(test "$soname" = libkvq.so.0; echo $?)" "soname '$soname', expected libkvq.so.0"
ver=$(sed -n 's/^#define KVQ_VERSION "\(.*\)"/\1/p' runtime/include/kvq.h)
out=$("$prefix/bin/kvq" --version)
check kvq_version "$(test "$out" = "kvq $ver"; echo $?)" "kvq --version said '$out'"
out=$("$prefix/bin/kvqc" --version)
check kvqc_version "$(test "$out" = "kvqc $ver"; echo $?)" "kvqc --version said '$out'"
out=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --modversion kvq)
check pkgconfig_version "$(test "$out" = "$ver"; echo $?)" "pkg-config --modversion kvq said '$out'"

# Built from outside the checkout: nothing but the installed files can be found.
cp tests/install/host.c "$work/"
cd "$work" || exit 1
flags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs kvq)
${CC:-cc} -std=c11 -Wall -Wextra -Werror -o host host.c $flags -lm >build.log 2>&1
check host_builds "$?" "cc host.c $flags: $(cat build.log)"
LD_LIBRARY_PATH="$prefix/lib" ./host "$prefix/share/kvq/specs/kivi4.kvq" reference >ref.out 2>&1
rc=$?
check host_runs_reference "$rc" "$(cat ref.out)"
err=$(sed -n 's/^attn_rel_err //p' ref.out)
check host_kivi4_error "$(awk -v e="$err" 'BEGIN { exit !(e > 0 && e < 0.2) }'; echo $?)" \
    "attention error '$err' (expected in (0, 0.2) for KIVI-4)"
check host_version_matches "$(grep -q "^version $ver $ver\$" ref.out; echo $?)" "$(grep version ref.out)"
dir=$(sed -n 's/^data_dir //p' ref.out)
check installed_data_dir "$(test "$dir" = "$(cd "$prefix/share/kvq" && pwd -P)"; echo $?)" \
    "the installed library reads its data from '$dir', expected $prefix/share/kvq"
# The emu backend compiles the installed templates and emulator sources: proof they are found and complete.
LD_LIBRARY_PATH="$prefix/lib" KVQ_CACHE_DIR="$work/cache" ./host "$prefix/share/kvq/specs/kivi4.kvq" emu >emu.out 2>&1
rc=$?
check host_runs_emu_installed "$rc" "$(cat emu.out)"
e2=$(sed -n 's/^attn_rel_err //p' emu.out)
check emu_matches_reference "$(awk -v a="$err" -v b="$e2" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d < 1e-3) }'; echo $?)" \
    "emu error '$e2', reference '$err'"
cd "$src" || exit 1
