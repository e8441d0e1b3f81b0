#!/usr/bin/env python3
"""Every kernel of a decode step, from Nsight Compute (docs/gpu.md; tools/gpu-check.sh's ncu-step-b1.csv).

    tools/ncu-step.py NCU_CSV

NCU_CSV: `ncu --profile-from-start off --csv --page raw --metrics gpu__time_duration.sum --log-file NCU_CSV
bench_gpu_decode ... --no-graph --profile-steps`: one row per kernel the steps launched (the benchmark opens the
profiler's range around each timed eager step only), in launch order. A step ends with its kvq_merge; a step whose
decode needed no merge (one chunk) ends at the next kernel that follows a kvq_decode_c* kernel and is not a merge,
so such a step is cut after its decode kernel. Prints one line a step: its kernels with their microseconds, in
order, and their sum (the gaps between kernels are not in it: compare with the benchmark's step time). Exit 0, 2
on bad input.
"""
import csv
import sys


def read(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "gpu__time_duration.sum" in r), None)
    if head is None:
        raise ValueError("no header with 'Kernel Name' and 'gpu__time_duration.sum'")
    h = rows[head]
    k_col, t_col = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
    ks = []
    for r in rows[head + 1:]:
        if len(r) <= max(k_col, t_col):
            continue
        try:
            ns = float(r[t_col].replace(",", ""))
        except ValueError:
            continue  # the units row
        ks.append((r[k_col].split("(")[0].strip(), ns / 1e3))
    return ks


def steps_of(ks):
    steps, cur = [], []
    for i, (name, us) in enumerate(ks):
        cur.append((name, us))
        nxt = ks[i + 1][0] if i + 1 < len(ks) else None
        if name == "kvq_merge" or (name.startswith("kvq_decode_c") and nxt != "kvq_merge" and
                                   not (nxt or "").startswith("kvq_decode_c")):
            steps.append(cur)
            cur = []
    if cur:
        steps.append(cur)
    return steps


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        ks = read(argv[1])
    except (OSError, ValueError) as e:
        print("ncu-step: %s" % e, file=sys.stderr)
        return 2
    if not ks:
        print("no kernels in %s (was the benchmark run with --profile-steps under --profile-from-start off?)" % argv[1])
        return 0
    for n, st in enumerate(steps_of(ks)):
        dec = sum(us for name, us in st if name.startswith("kvq_decode_c"))
        print("- step %d: %s; kernels %.1f us, of them decode %.1f" % (
            n, ", ".join("%s %.1f" % (name, us) for name, us in st), sum(us for _, us in st), dec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
