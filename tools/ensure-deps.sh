#!/bin/sh
# Makes sure the build tools kvq needs are present: installs them with apt-get when run as root on Debian,
# otherwise names what is missing and how to get it.
# `tools/ensure-deps.sh --fuzz` (used by `make fuzz` only): clang and its libFuzzer runtime as well.
missing=""
command -v flex >/dev/null 2>&1 || missing="$missing flex"
command -v bison >/dev/null 2>&1 || missing="$missing bison"
command -v cc >/dev/null 2>&1 || missing="$missing gcc"
command -v make >/dev/null 2>&1 || missing="$missing make"
command -v pkg-config >/dev/null 2>&1 || missing="$missing pkg-config"  # the install test (tests/sh)
if [ "$1" = --fuzz ]; then
    command -v clang >/dev/null 2>&1 || missing="$missing clang"
    # libFuzzer: Debian ships it in libclang-rt-dev (clang's compiler-rt)
    if command -v clang >/dev/null 2>&1; then
        t=$(mktemp -d)
        printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' \
            >"$t/f.c"
        clang -fsanitize=fuzzer "$t/f.c" -o "$t/f" >/dev/null 2>&1 || missing="$missing libclang-rt-dev"
        rm -rf "$t"
    else
        missing="$missing libclang-rt-dev"
    fi
fi
# LLVM 19 (the cpu backend's code generator) is optional: installed when we can, never required.
# LLVM 19 with its development files (tools/find-llvm.sh: llvm-config-19 alone is not enough).
llvm=""
[ -n "$(sh "$(dirname "$0")/find-llvm.sh")" ] || llvm="llvm-19-dev"
if [ -n "$llvm" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvq: installing $llvm (the cpu backend's code generator)"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq $llvm >/dev/null; } ||
        echo "kvq: apt-get install $llvm failed; the cpu backend will be unavailable" >&2
elif [ -n "$llvm" ]; then
    echo "kvq: LLVM 19's development files (llvm-config-19, llvm-c/Core.h, libLLVM-19.so) not found: the cpu backend will be unavailable (on Debian: sudo apt-get install llvm-19-dev)" >&2
fi
[ -z "$missing" ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "kvq: installing missing build tools:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq $missing >/dev/null && exit 0
    echo "kvq: apt-get install$missing failed" >&2
    exit 1
fi
echo "kvq: missing build tools:$missing" >&2
echo "kvq: install them (on Debian: sudo apt-get install$missing) and run make again" >&2
exit 1
