#!/usr/bin/env python3
"""One warp's path through a kernel's SASS, counted by hand (docs/cuda.md, "Load path": the staging's hand count).

    tools/sass-walk.py SASS START END DECISIONS [--fn NAME] [--trace]

SASS: `nvdisasm -gi -c` text of a cubin (kvqc build --cost leaves DIR/<spec>/sm_90-lineinfo.cubin). START, END: hex
addresses of the first instruction counted and of the one that ends the walk (not counted). DECISIONS: a JSON file,
{"<hex address of a conditional BRA>": true | false | [k]}: taken, not taken, or taken k times and then not (a
loop's back branch). Unconditional branches are followed, NOPs not counted. The walk stops at the first branch the
file does not decide and prints it with the instructions before it (with --trace, every instruction of the path),
so the decisions are made one at a time from the code's meaning: which tile kind, which warp, which trip count.

Prints "executed N instructions"; exit status 0 when END was reached, 1 at an undecided branch, 2 on bad input.
"""
import json
import re
import sys


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    fn = "kvq_decode_c0"
    for a in argv[1:]:
        if a.startswith("--fn="):
            fn = a[5:]
    trace = "--trace" in argv
    if len(args) != 4:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    sass, start, end, dec_path = args[0], int(args[1], 16), int(args[2], 16), args[3]
    with open(dec_path) as f:
        dec = {int(k, 16): v for k, v in json.load(f).items()}
    ins, labels, pend, infn = [], {}, [], False
    with open(sass) as f:
        for line in f:
            if line.startswith(".text." + fn + ":"):
                infn = True
                continue
            if infn and line.startswith(".text."):
                break
            if not infn:
                continue
            m = re.match(r"^(\.L_x_\d+):", line)
            if m:
                pend.append(m.group(1))
                continue
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m:
                a = int(m.group(1), 16)
                for p in pend:
                    labels[p] = a
                pend = []
                ins.append((a, m.group(2)))
    idx = {a: i for i, (a, _) in enumerate(ins)}
    if start not in idx or end not in idx:
        print("sass-walk: START or END is not an instruction of %s" % fn, file=sys.stderr)
        return 2
    i, n, taken = idx[start], 0, {}
    for _ in range(10 ** 6):
        a, op = ins[i]
        if a == end:
            print("executed %d instructions from %x to %x" % (n, start, end))
            return 0
        if not op.startswith("NOP"):
            n += 1
        if trace:
            print("  %x %s" % (a, op))
        w = op.split()
        if w and (w[0] == "BRA" or (op.startswith("@") and len(w) > 1 and w[1] == "BRA")):
            m = re.search(r"`\((\.L_x_\d+)\)", op)
            tgt = labels[m.group(1)]
            if w[0] == "BRA" and not re.search(r"BRA\s+!?U?P\d", op):
                i = idx[tgt]
                continue
            if a not in dec:
                print("undecided at %x: %s (%d instructions so far)" % (a, op, n))
                for j in range(max(0, i - 8), i):
                    print("    %x %s" % ins[j])
                return 1
            d = dec[a]
            if isinstance(d, list):
                c = taken.get(a, 0)
                taken[a] = c + 1
                d = c < d[0]
            if d:
                i = idx[tgt]
                continue
        if w and w[0] in ("EXIT", "RET"):
            print("sass-walk: the path left the kernel at %x" % a, file=sys.stderr)
            return 2
        i += 1
    print("sass-walk: no END after 10^6 instructions (a loop's decision?)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
