#!/bin/sh
# Makes sure the build tools kvq needs are present: installs them with apt-get when run as root on Debian,
# otherwise names what is missing and how to get it.
missing=""
command -v flex >/dev/null 2>&1 || missing="$missing flex"
command -v bison >/dev/null 2>&1 || missing="$missing bison"
command -v cc >/dev/null 2>&1 || missing="$missing gcc"
command -v make >/dev/null 2>&1 || missing="$missing make"
command -v pkg-config >/dev/null 2>&1 || missing="$missing pkg-config"  # the install test (tests/sh)
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
