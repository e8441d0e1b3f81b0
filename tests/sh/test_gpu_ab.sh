#!/bin/sh
# `make gpu-ab` (tools/gpu-ab.sh, docs/gpu.md "Same machine, several builds") without a GPU: bad build lists are
# refused before any build; the checkout as it is (".") builds into a folder with its benchmark, specs and an
# NVRTC cache filled through the fake driver; that folder's ab.sh then runs on the recording fake driver with a
# stand-in ncu (a script printing a fabricated raw CSV of ncu's columns), two rounds, and its summary reads the
# kernel rows, the batch-32 graph figure and a layer's share of a 2-layer step of each round. One PASS/FAIL line per case.
cd "$(dirname "$0")/../.." || exit 1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
check() { # name, condition result (0 ok), message
    if [ "$2" -eq 0 ]; then echo "PASS $1"; else echo "FAIL $1: $3"; fi
}
if ! command -v python3 >/dev/null 2>&1; then echo "SKIP gpu_ab: no python3 (ab.sh's summary)"; exit 0; fi

# refused before building: not NAME=REV, an unknown revision, a name twice, a name with a slash
bad=0 msg=""
for args in "x" "a=no-such-revision-kvq" "a=HEAD a=." "a/b=HEAD"; do
    # shellcheck disable=SC2086
    if sh tools/gpu-ab.sh "$work/bad" $args >"$work/bad.log" 2>&1 || ! grep -q '^gpu-ab: ' "$work/bad.log" ||
        [ -d "$work/bad/src" ]; then
        bad=1 msg="$msg; '$args': $(cat "$work/bad.log")"
    fi
done
check gpu_ab_refuses_bad_lists "$bad" "${msg#; }"

# the checkout, fp16's unit only (GPU_AB_SPECS empty: the fill compiles fp16 alone); its sources kept for the
# build's own fake driver below
GPU_AB_KEEP=1 GPU_AB_SPECS=" " sh tools/gpu-ab.sh "$work/ab" checkout=. >"$work/make.log" 2>&1
st=$?
check gpu_ab_builds "$st" "$(tail -n 20 "$work/make.log")"
[ "$st" -eq 0 ] || exit 0
ab="$work/ab"
ok=1
[ -x "$ab/ab.sh" ] && [ -x "$ab/checkout/bench_gpu_decode" ] && [ -f "$ab/checkout/specs/kivi2.kvq" ] &&
    [ "$(find "$ab/checkout/cache" -type f | wc -l)" -ge 1 ] && grep -q '^checkout: the checkout at ' "$ab/MANIFEST" &&
    [ "$(cat "$ab/BUILDS")" = checkout ] && ok=0
check gpu_ab_folder "$ok" "$(cd "$ab" && find . -maxdepth 2 | sort | tr '\n' ' '; cat "$ab/MANIFEST")"

# ab.sh on the fake driver, with an ncu that prints ncu's raw CSV layout (banner, header, units row, one kernel)
mkdir -p "$work/bin"
cat >"$work/bin/ncu" <<'N'
#!/bin/sh
echo "==PROF== Connected to process 1 (bench_gpu_decode)"
echo '"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread","smsp__average_warp_latency_per_inst_issued.ratio","smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio","smsp__inst_executed.sum"'
echo '"","","us","register/thread","","",""'
echo '"0","kvq_decode_c0","50.11","123","5.49","0.41","23,267,064"'
N
chmod +x "$work/bin/ncu"
fake="$ab/src/checkout/build/gpu-nollvm/tests/fakecuda/libcuda.so.1"
(cd "$work" && PATH="$work/bin:$PATH" KVQ_LIBCUDA="$fake" timeout 300 "$ab/ab.sh" --rounds 2 --batch32 --layers 2 --out "$work/res") \
    >"$work/run.log" 2>&1
st=$?
ok=1
s="$work/res/summary.md"
[ "$st" -eq 0 ] && [ -f "$work/res.tar.gz" ] && grep -q '^| checkout | fp16 | 1 | 50.11 | 23267064 | 5.49 | 0.41 | 123 | ' "$s" &&
    grep -q '^| checkout | fp16 | 2 | 50.11 | ' "$s" && grep -Eq '^\| checkout \| fp16 \| 2 \| .* \| [0-9.]+ \| [0-9.]+ \|$' "$s" && ok=0
check gpu_ab_runs_and_summarises "$ok" "exit $st: $(cat "$work/run.log")"
# bad options of ab.sh
"$ab/ab.sh" --rounds 0 --out "$work/x" >/dev/null 2>&1
r1=$?
"$ab/ab.sh" --rounds 1 >/dev/null 2>&1
r2=$?
"$ab/ab.sh" --layers x --out "$work/x" >/dev/null 2>&1
r3=$?
check gpu_ab_run_options "$( [ "$r1" = 2 ] && [ "$r2" = 2 ] && [ "$r3" = 2 ]; echo $?)" \
    "--rounds 0: exit $r1, no --out: exit $r2, --layers x: exit $r3"
