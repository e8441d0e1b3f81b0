#!/bin/sh
# Prints the path of a usable llvm-config-19 (nothing when there is none): usable means with LLVM 19's development
# files beside it, the C API's headers and the libLLVM-19.so link (llvm-19-dev). llvm-config-19 alone comes with
# the llvm-19 package and stays after `apt-get remove llvm-19-dev`. Used by tools/ensure-deps.sh and
# runtime/cpu/cpu.mk, so that both ask the same question.
c=$(command -v llvm-config-19 2>/dev/null) || exit 0
[ -f "$($c --includedir 2>/dev/null)/llvm-c/Core.h" ] || exit 0
$c --link-shared --libs >/dev/null 2>&1 || exit 0
echo "$c"
