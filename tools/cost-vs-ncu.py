#!/usr/bin/env python3
"""The cost model against the machine, block by block (docs/cuda.md, "Cost model").

    tools/cost-vs-ncu.py NCU_CSV MODEL_LIST [--top N] [--conflicts N]

NCU_CSV: Nsight Compute's source page of one kernel launch as CSV, SASS view (tools/gpu-check.sh writes
ncu-pc-<scheme>.csv: `ncu -i REPORT --page source --print-source sass --csv`): one row per SASS instruction with
its address and "Instructions Executed" (warp-level executions, predicated-off included: what
smsp__inst_executed sums).
MODEL_LIST: the stderr of `KVQ_COST_DEBUG=kvq_decode_c0 kvqc build SPEC --arch sm_90 -o DIR --cost
--cost-tokens 32768` for the same cubin and workload: one line per SASS basic block, "block K ins A..B n N reach R
count C est E addr X..Y [line:count]...", X and Y the offsets of its first and last instruction.

Prints the totals (model, measured, their ratio), the code the launch ran (distinct instructions executed) with its
no-instruction stalls where the CSV has ncu's stall sampling columns, and the N blocks whose executed instructions differ most
(count x instructions, model against measured), with the instructions' measured executions within the block
(a basic block's instructions run equally often; a spread says the model's block boundaries are wrong there).
Addresses: ncu's may be absolute; they are taken relative to the first instruction. Exit status 0, 2 on bad
input.

--conflicts N: also the shared-memory bank conflicts, where the CSV has ncu's "L1 Wavefronts Shared" and "L1
Wavefronts Shared Excessive" columns (gpu-check.sh's SourceCounters export does): the kernel's total and excess
wavefronts, then the N instructions with the most excess wavefronts, each with its executions, wavefronts per
execution, its block and the block's source lines from the model list (docs/cuda.md "Bank conflicts": the H200
runs found the per-page query work's conflicts this way). MODEL_LIST may then be "-" (no model: gpu-check.sh on
the GPU machine, which has no nvdisasm).
"""
import csv
import re
import sys


def read_model(path):
    blocks = []
    lines_pat = re.compile(r"\[(\d+):")
    pat = re.compile(r"^block (\d+) ins (\d+)\.\.(\d+) n (\d+) reach (\d+) count (\S+) est (\S+) addr ([0-9a-f]+)\.\.([0-9a-f]+)")
    with open(path) as f:
        for line in f:
            m = pat.match(line)
            if not m:
                continue
            count = float(m.group(6))
            blocks.append({
                "id": int(m.group(1)), "n": int(m.group(4)), "count": count if count < 1e200 else None,
                "first": int(m.group(8), 16), "last": int(m.group(9), 16),
                "lines": sorted(set(int(x) for x in lines_pat.findall(line[m.end():]))),
            })
    return blocks


def read_ncu(path):
    """{offset: (executed, source text)} of the instructions of the table in the CSV."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head = None
    for i, r in enumerate(rows):
        names = [c.strip() for c in r]
        if any("Address" in c for c in names) and any(c == "Instructions Executed" or c == "inst_executed" for c in names):
            head = i
            break
    if head is None:
        raise ValueError("no header with an address and 'Instructions Executed' column")
    h = [c.strip() for c in rows[head]]
    a_col = next(i for i, c in enumerate(h) if "Address" in c)
    e_col = next(i for i, c in enumerate(h) if c in ("Instructions Executed", "inst_executed"))
    s_col = next((i for i, c in enumerate(h) if c == "Source"), None)
    w_col = next((i for i, c in enumerate(h) if c == "L1 Wavefronts Shared"), None)
    t_col = next((i for i, c in enumerate(h) if c == "Warp Stall Sampling (All Samples)"), None)
    n_col = next((i for i, c in enumerate(h) if c == "stall_no_inst"), None)
    x_col = next((i for i, c in enumerate(h) if c == "L1 Wavefronts Shared Excessive"), None)

    def num(r, col):
        if col is None or col >= len(r):
            return None
        try:
            return float(r[col].strip().replace(",", "") or 0)
        except ValueError:
            return 0.0
    out = {}
    for r in rows[head + 1:]:
        if len(r) <= max(a_col, e_col):
            continue
        a, e = r[a_col].strip(), r[e_col].strip().replace(",", "")
        try:
            addr = int(a, 16)  # "0x7f..." (absolute) or an offset
            executed = float(e) if e else 0.0
        except ValueError:
            continue  # a units row or a second table's header
        out[addr] = (executed, r[s_col].strip() if s_col is not None and s_col < len(r) else "", num(r, w_col),
                     num(r, x_col), num(r, t_col), num(r, n_col))
    if not out:
        raise ValueError("no instruction rows")
    base = min(out)
    return {a - base: v for a, v in out.items()}


def fetch_line(pcs):
    """The code the launch ran (distinct instructions executed, 16 bytes each) and the samples of warps stalled for
    want of their next instruction (ncu's stall_no_inst, "no instruction"), when the CSV has the sampling columns:
    docs/gpu-results.md run 7 found these rise together when a change made the step run more distinct code."""
    code = [v for v in pcs.values() if not v[1].startswith("NOP")]
    ran = sum(1 for v in code if v[0] > 0)
    line = "code executed: %d of %d instructions (%.1f KiB)" % (ran, len(code), ran * 16 / 1024.0)
    if all(v[4] is not None and v[5] is not None for v in code) and code:
        total = sum(v[4] for v in code)
        noinst = sum(v[5] for v in code)
        line += "; no-instruction stalls: %.0f of %.0f samples (%.1f %%)" % (noinst, total,
                                                                          100.0 * noinst / total if total else 0.0)
    return line


def main(argv):
    top = 20
    conflicts = 0
    args = []
    i = 1
    while i < len(argv):
        if argv[i] in ("--top", "--conflicts") and i + 1 < len(argv):
            try:
                v = int(argv[i + 1])
            except ValueError:
                print("cost-vs-ncu: %s wants a number, not %r" % (argv[i], argv[i + 1]), file=sys.stderr)
                return 2
            if argv[i] == "--top":
                top = v
            else:
                conflicts = v
            i += 2
            continue
        args.append(argv[i])
        i += 1
    if len(args) != 2:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    no_model = args[1] == "-"
    if no_model and not conflicts:
        print("cost-vs-ncu: MODEL_LIST - (none) needs --conflicts", file=sys.stderr)
        return 2
    try:
        blocks = [] if no_model else read_model(args[1])
        pcs = read_ncu(args[0])
    except (OSError, ValueError, StopIteration) as e:
        print("cost-vs-ncu: %s" % e, file=sys.stderr)
        return 2
    if not blocks and not no_model:
        print("cost-vs-ncu: no block lines in %s (run kvqc with KVQ_COST_DEBUG=<kernel>)" % args[1], file=sys.stderr)
        return 2
    if no_model:
        print("measured %.0f warp-instructions (ncu)" % sum(v[0] for v in pcs.values()))
        print(fetch_line(pcs))
    else:
        model_total = measured_total = 0.0
        rows = []
        placed = set()
        for b in blocks:
            ex = [pcs[a][0] for a in range(b["first"], b["last"] + 16, 16)
                  if a in pcs and not pcs[a][1].startswith("NOP")]
            placed.update(range(b["first"], b["last"] + 16, 16))
            measured = sum(ex)
            model = (b["count"] or 0.0) * b["n"]
            model_total += model
            measured_total += measured
            per = measured / len(ex) if ex else 0.0
            rows.append((model - measured, b, per, (min(ex), max(ex)) if ex else (0, 0), model, measured))
        outside = sum(v[0] for a, v in pcs.items() if a not in placed)
        print("model %.0f warp-instructions, measured %.0f (ncu), model / measured %.3f; measured outside the model's "
              "blocks %.0f" % (model_total, measured_total, model_total / measured_total if measured_total else float("nan"),
                               outside))
        print(fetch_line(pcs))
        last = max(a for a, v in pcs.items() if not v[1].startswith("NOP"))
        if max(b["last"] for b in blocks) != last:
            print("note: the model's last instruction is at 0x%x, ncu's at 0x%x (another cubin?)" % (
                max(b["last"] for b in blocks), last))
        rows.sort(key=lambda r: -abs(r[0]))
        print("%6s %13s %5s %12s %12s %14s %14s %s" % ("block", "addr", "n", "model", "measured", "model instr",
                                                        "measured instr", "spread"))
        for d, b, per, (lo, hi), model, measured in rows[:top]:
            if d == 0:
                break
            print("%6d %6x..%-5x %5d %12s %12.0f %14.0f %14.0f %s" % (
                b["id"], b["first"], b["last"], b["n"], "%.0f" % b["count"] if b["count"] is not None else "unknown",
                per, model, measured, "" if lo == hi else "%.0f..%.0f" % (lo, hi)))
    if conflicts:
        rows = [(a, v) for a, v in pcs.items() if v[2] is not None and v[3] is not None]
        if not rows:
            print("shared memory: the CSV has no 'L1 Wavefronts Shared' and 'L1 Wavefronts Shared Excessive' columns")
            return 0
        wf = sum(v[2] for a, v in rows)
        ex = sum(v[3] for a, v in rows)
        print("shared memory: %.0f wavefronts, %.0f of them excess (%.1f %%)" % (wf, ex, 100.0 * ex / wf if wf else 0.0))
        print("%8s %12s %10s %10s %6s  %-36s %s" % ("addr", "excess", "executed", "wf/exec", "block", "instruction",
                                                  "block's lines"))
        for a, v in sorted(rows, key=lambda x: -x[1][3])[:conflicts]:
            if v[3] <= 0:
                break
            b = next((b for b in blocks if b["first"] <= a <= b["last"]), None)
            print("%8x %12.0f %10.0f %10.1f %6s  %-36s %s" % (
                a, v[3], v[0], v[2] / v[0] if v[0] else 0.0, b["id"] if b else "-", v[1][:36],
                " ".join(str(x) for x in b["lines"][:8]) if b else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
