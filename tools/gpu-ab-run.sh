#!/bin/sh
# Runs the builds of `make gpu-ab` (tools/gpu-ab.sh) on one GPU machine, in turn, in one call (copied there as
# ab.sh): per build and round, Nsight Compute on the decode kernels of one step at 32k tokens, batch 1 (launch
# order fp16, then the specs in SPECS): kernel time, executed warp-instructions, cycles an issue and the
# no-instruction stall (warps waiting for their next instruction to be fetched: docs/gpu-results.md run 7);
# --batch32 adds the benchmark's graph step at batch 32, --layers N a layer's share of a graph step of N layers at
# batch 1 (the code stays in L2 between layers, as in a model's decode). Rounds alternate the builds' order, so that a machine
# that drifts during the call shows as a spread, not as a difference. Prints the table and packs DIR as
# DIR.tar.gz.
#   ab.sh [--dry-run] [--batch32] [--layers N] [--rounds N] --out DIR
set -u
here=$(cd "$(dirname "$0")" && pwd)
dry=0 b32=0 layers=0 rounds=2 out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --batch32) b32=1 ;;
        --rounds) rounds=${2:-}; shift ;;
        --layers) layers=${2:-}; shift ;;
        --out) out=${2:-}; shift ;;
        *) echo "usage: $0 [--dry-run] [--batch32] [--layers N] [--rounds N] --out DIR" >&2; exit 2 ;;
    esac
    shift
done
case "$rounds" in '' | *[!0-9]* | 0) echo "ab.sh: --rounds wants a positive number" >&2; exit 2 ;; esac
case "$layers" in '' | *[!0-9]*) echo "ab.sh: --layers wants a number" >&2; exit 2 ;; esac
[ -n "$out" ] || { echo "ab.sh: --out DIR is required" >&2; exit 2; }
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
for d in /usr/local/cuda/bin /opt/nvidia/nsight-compute/*; do
    [ -d "$d" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH="$PATH:$d" ;; esac
done
export PATH KVQ_GENERATED_DIR=/nonexistent
builds=$(cat "$here/BUILDS") specs=$(cat "$here/SPECS")
run() { # LOG CMD...: the command, or in a dry run its line
    log=$1
    shift
    if [ "$dry" = 1 ]; then echo "dry run: $*" >>"$log"; return 0; fi
    timeout 60 "$@" >"$log" 2>&1
}
have_ncu=1
[ "$dry" = 1 ] || command -v ncu >/dev/null 2>&1 || have_ncu=0
[ "$have_ncu" = 1 ] || echo "ab.sh: ncu not found; the batch-1 kernel rows are skipped" >&2
r=1
while [ "$r" -le "$rounds" ]; do
    order=$builds
    [ $((r % 2)) = 0 ] && order=$(echo "$builds" | sed -n '1!G;h;$p') # even rounds: the builds in reverse
    for b in $order; do
        cd "$here/$b" || exit 2
        export KVQ_CACHE_DIR="$here/$b/cache" KVQ_SRCDIR="$here/$b"
        if [ "$have_ncu" = 1 ]; then
            # shellcheck disable=SC2086
            run "$out/$b-ncu-r$r.csv" ncu --clock-control none --section WarpStateStats --page raw --csv \
                --metrics smsp__inst_executed.sum,launch__registers_per_thread,gpu__time_duration.sum \
                --kernel-name regex:kvq_decode_c --launch-count $((1 + $(echo $specs | wc -w))) \
                ./bench_gpu_decode --ctx 32k --batch 1 --steps 1 --warmup 0 --hbm-mib 0 --no-graph $specs
        fi
        # shellcheck disable=SC2086
        [ "$b32" = 1 ] && run "$out/$b-b32-r$r.md" ./bench_gpu_decode --ctx 32k --batch 32 --steps 6 --hbm-mib 0 $specs
        # shellcheck disable=SC2086
        [ "$layers" -gt 0 ] && run "$out/$b-layers-r$r.md" ./bench_gpu_decode --ctx 32k --batch 1 --steps 6 --hbm-mib 0 \
            --layers "$layers" $specs
        echo "ab.sh: round $r, $b done" >&2
    done
    r=$((r + 1))
done
if [ "$dry" = 0 ] && command -v python3 >/dev/null 2>&1; then
    python3 - "$out" "$builds" "$specs" "$rounds" <<'EOF' | tee "$out/summary.md"
import csv, os, re, sys
out, builds, specs, rounds = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
schemes = ["fp16"] + [os.path.basename(s).rsplit(".", 1)[0] for s in specs]
print("| build | scheme | round | kernel us | warp-instr | cycles an issue | no-instruction stall | regs "
      "| graph us, batch 32 | graph us a layer, batch 1, layers |")
print("|---|---|---|---|---|---|---|---|---|---|")
for b in builds:
    for r in range(1, rounds + 1):
        rows = []
        p = "%s/%s-ncu-r%d.csv" % (out, b, r)
        if os.path.exists(p):
            lines = open(p).read().split("\n")
            head = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
            if head is not None:
                t = list(csv.reader(lines[head:]))
                h = t[0]
                rows = [x for x in t[2:] if len(x) == len(h)]
        def graphs(q, batch):
            g = {}
            if os.path.exists(q):
                for l in open(q):
                    c = [x.strip() for x in l.split("|")]
                    if len(c) > 8 and c[2] == batch:
                        g[c[1]] = c[7]
            return g
        graph = graphs("%s/%s-b32-r%d.md" % (out, b, r), "32")
        layer = graphs("%s/%s-layers-r%d.md" % (out, b, r), "1")
        for i, s in enumerate(schemes):
            if i < len(rows):
                x = rows[i]
                g = lambda n: x[h.index(n)].replace(",", "") if n in h else "?"
                cells = [g("gpu__time_duration.sum"), g("smsp__inst_executed.sum"),
                         g("smsp__average_warp_latency_per_inst_issued.ratio"),
                         g("smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio"),
                         g("launch__registers_per_thread")]
            else:
                cells = ["-"] * 5
            print("| %s | %s | %d | %s | %s | %s |" % (b, s, r, " | ".join(cells), graph.get(s, "-"), layer.get(s, "-")))
EOF
fi
tar -C "$(dirname "$out")" -czf "$out.tar.gz" "$(basename "$out")" && echo "ab.sh: packed $out.tar.gz"
