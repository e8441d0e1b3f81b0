#!/bin/sh
# tools/sass-walk.py (docs/cuda.md, "Load path": the staging's hand count) on fabricated nvdisasm text: a kernel
# whose path runs a block, a loop taken twice back ([2]: three trips), skips a branch it is told is taken, follows
# an unconditional branch and stops at END; an undecided branch stops the walk (exit 1) and names itself.
# Prints PASS/FAIL lines (tests/run.sh).
cd "$(dirname "$0")/../.." || exit 1
name="sass-walk: one warp's path through fabricated SASS, loops and branches as decided"
if ! command -v python3 >/dev/null 2>&1; then echo "SKIP $name: no python3"; exit 0; fi
d=$(mktemp -d) || exit 1
trap 'rm -rf "$d"' EXIT
cat >"$d/k.sass" <<'S'
.text.kvq_other:
        /*0000*/                   EXIT ;
.text.kvq_decode_c0:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x40, PT ;
.L_x_1:
        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0030*/                   NOP ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   FADD R3, R3, R4 ;
.L_x_2:
        /*0070*/                   BRA `(.L_x_3) ;
        /*0080*/                   FMUL R3, R3, R4 ;
.L_x_3:
        /*0090*/              @!P2 BRA P3, `(.L_x_4) ;
        /*00a0*/                   EXIT ;
.L_x_4:
        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.text.kvq_merge:
S
printf '{"40": [2], "50": true, "90": true}' >"$d/ok.json"
printf '{"40": [2], "50": true}' >"$d/open.json"
fail=""
# 0: 2 instructions, the loop's 2 (no NOP) three times, the taken branch, the BRA, the decided BRA: 2 + 6 + 3 = 11
out=$(python3 tools/sass-walk.py "$d/k.sass" 0 b0 "$d/ok.json" 2>&1)
[ $? -eq 0 ] || fail="exit $?"
[ "$out" = "executed 11 instructions from 0 to b0" ] || fail="$fail; walk: $out"
out=$(python3 tools/sass-walk.py "$d/k.sass" 0 b0 "$d/open.json" 2>&1)
[ $? -eq 1 ] || fail="$fail; an undecided branch did not stop the walk"
echo "$out" | grep -q "^undecided at 90: @!P2 BRA P3" || fail="$fail; undecided: $out"
python3 tools/sass-walk.py "$d/k.sass" 0 c0 "$d/ok.json" >/dev/null 2>&1
[ $? -eq 2 ] || fail="$fail; an END that is no instruction was accepted"
if [ -z "$fail" ]; then echo "PASS $name"; else echo "FAIL $name: ${fail#; }"; fi
