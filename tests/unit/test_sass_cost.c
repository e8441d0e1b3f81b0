/* kvqc build --cost's SASS side (compiler/sass_cost.c; docs/cuda.md, "Cost model"): basic blocks of hand-written
 * nvdisasm -gi text, each counted from the profile's warp counts of its lines (with their inlining), loops by
 * their real trip counts, code one warp runs charged once, unreachable code and copies bounded by the flow. */
#include <string.h>

#include "harness.h"
#include "sass_cost.h"

#define I(a, text) "        /*" a "*/                   " text " ;\n"
#define F(l) "\t//## File \"k.cu\", line " #l "\n"
#define FI(l, at) "\t//## File \"k.cu\", line " #l " inlined at \"k.cu\", line " #at "\n"

/* entry (line 10); a loop of lines 20-21 inlined at 12; a store only warp 0 makes (line 31, branched around);
 * the exit; the trailing self-branch nothing reaches */
static const char sass[] = "//--------------------- .text.k --------------------------\n"
                           "\t.section\t.text.k,\"ax\",@progbits\n"
                           ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]") I("0010", "MOV R2, RZ")
                           ".L_x_1:\n" FI(20, 12) F(12) I("0020", "FFMA R3, R3, R3, R3") I("0030", "FFMA R3, R3, R3, R3")
                           FI(21, 12) F(12) I("0040", "ISETP.GE.AND P0, PT, R2, R4, PT") I("0050", "@!P0 BRA `(.L_x_1)")
                           F(30) I("0060", "@P1 BRA `(.L_x_2)") F(31) I("0070", "STG.E [R4.64], R3")
                           ".L_x_2:\n" F(40) I("0080", "EXIT")
                           ".L_x_3:\n" I("0090", "BRA `(.L_x_3)")
                           "\t.section\t.text.other,\"ax\",@progbits\n";

/* a dispatch on one source line (50, as KVQ_BY_KIND's branches all lie on the macro's line) with the same loop
 * inlined in each branch: copy A (fall-through) and copy B (branched to), then the exit */
static const char sass_alt[] = "//--------------------- .text.k --------------------------\n"
                               "\t.section\t.text.k,\"ax\",@progbits\n"
                               ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]") F(50) I("0010", "@P0 BRA `(.L_x_5)")
                               ".L_x_4:\n" FI(20, 50) F(50) I("0020", "FFMA R3, R3, R3, R3") I("0030", "FFMA R3, R3, R3, R3")
                               FI(21, 50) F(50) I("0040", "ISETP.GE.AND P1, PT, R2, R4, PT") I("0050", "@!P1 BRA `(.L_x_4)")
                               F(50) I("0060", "BRA `(.L_x_6)")
                               ".L_x_5:\n" FI(20, 50) F(50) I("0070", "FFMA R3, R3, R3, R3") I("0080", "FFMA R3, R3, R3, R3")
                               FI(21, 50) F(50) I("0090", "ISETP.GE.AND P1, PT, R2, R4, PT") I("00a0", "@!P1 BRA `(.L_x_5)")
                               ".L_x_6:\n" F(40) I("00b0", "EXIT")
                               "\t.section\t.text.other,\"ax\",@progbits\n";

/* a loop whose body holds two copies of line 60 (a fully unrolled inner loop whose condition and body share the
 * line), the second after an if (line 62) that skips a store (63) */
static const char sass_seq[] = "//--------------------- .text.k --------------------------\n"
                               "\t.section\t.text.k,\"ax\",@progbits\n"
                               ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]")
                               ".L_x_7:\n" F(60) I("0010", "FADD R3, R3, R4") I("0020", "STG.E [R4.64], R3")
                               F(62) I("0030", "@P1 BRA `(.L_x_8)") F(63) I("0040", "STS [R5], R3")
                               ".L_x_8:\n" F(60) I("0050", "FADD R3, R3, R4") I("0060", "STG.E [R4.64], R3")
                               I("0070", "ISETP.GE.AND P0, PT, R2, R4, PT") I("0080", "@!P0 BRA `(.L_x_7)")
                               F(40) I("0090", "EXIT")
                               "\t.section\t.text.other,\"ax\",@progbits\n";

/* a dispatch (line 50) between a loop (copy A) and straight code (copy B) that starts with a line that never ran */
static const char sass_dead[] = "//--------------------- .text.k --------------------------\n"
                                "\t.section\t.text.k,\"ax\",@progbits\n"
                                ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]") F(50) I("0010", "@P0 BRA `(.L_x_12)")
                                ".L_x_11:\n" FI(20, 50) F(50) I("0020", "FFMA R3, R3, R3, R3")
                                FI(21, 50) F(50) I("0030", "ISETP.GE.AND P1, PT, R2, R4, PT") I("0040", "@!P1 BRA `(.L_x_11)")
                                F(50) I("0050", "BRA `(.L_x_13)")
                                ".L_x_12:\n" F(64) I("0060", "MOV R5, RZ") FI(20, 50) F(50) I("0070", "FFMA R3, R3, R3, R3")
                                FI(21, 50) F(50) I("0080", "ISETP.GE.AND P1, PT, R2, R4, PT")
                                ".L_x_13:\n" F(40) I("0090", "EXIT")
                                "\t.section\t.text.other,\"ax\",@progbits\n";

/* a store (line 31 inlined at 45 inlined at 50) branched around */
static const char sass_trunc[] = "//--------------------- .text.k --------------------------\n"
                                 "\t.section\t.text.k,\"ax\",@progbits\n"
                                 ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]") F(30) I("0010", "@P1 BRA `(.L_x_2)")
                                 FI(31, 45) FI(45, 50) F(50) I("0020", "STG.E [R4.64], R3")
                                 ".L_x_2:\n" F(40) I("0030", "EXIT")
                                 "\t.section\t.text.other,\"ax\",@progbits\n";

/* the loop of `sass` with the entry's threadIdx read and tid computed again inside it (line 10, as ptxas
 * rematerializes them under register pressure: KIVI-2's q.K loop) */
static const char sass_remat[] = "//--------------------- .text.k --------------------------\n"
                                 "\t.section\t.text.k,\"ax\",@progbits\n"
                                 ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]") I("0010", "MOV R2, RZ")
                                 ".L_x_1:\n" F(10) I("0020", "S2R R7, SR_TID.X") I("0030", "LOP3.LUT R8, R7, 0x1f, RZ, 0xc0, !PT")
                                 FI(20, 12) F(12) I("0040", "FFMA R3, R3, R3, R3") I("0050", "FFMA R3, R3, R3, R3")
                                 FI(21, 12) F(12) I("0060", "ISETP.GE.AND P0, PT, R2, R4, PT") I("0070", "@!P0 BRA `(.L_x_1)")
                                 F(40) I("0080", "EXIT")
                                 "\t.section\t.text.other,\"ax\",@progbits\n";

/* a loop (lines 70-73) whose body starts with an `if (...) continue;` (line 70: its comparison and branch) that
 * skips a store (72) */
static const char sass_cond[] = "//--------------------- .text.k --------------------------\n"
                                "\t.section\t.text.k,\"ax\",@progbits\n"
                                ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]")
                                ".L_x_30:\n" F(71) I("0010", "FFMA R3, R3, R3, R3") F(70) I("0020", "ISETP.GE.AND P0, PT, R2, R6, PT")
                                I("0030", "@P0 BRA `(.L_x_31)") F(72) I("0040", "STS [R5], R3")
                                ".L_x_31:\n" F(73) I("0050", "ISETP.GE.AND P1, PT, R2, R4, PT") I("0060", "@!P1 BRA `(.L_x_30)")
                                F(40) I("0070", "EXIT")
                                "\t.section\t.text.other,\"ax\",@progbits\n";

int main(void)
{
    /* 4 warps; the loop runs 10 times in each; one warp stores */
    sass_loc loc[6] = {{{10}, 1}, {{20, 12}, 2}, {{21, 12}, 2}, {{30}, 1}, {{31}, 1}, {{40}, 1}};
    double count[6] = {4, 40, 40, 4, 1, 4};
    unsigned char rolled[64] = {0};
    rolled[21] = 1; /* the loop's branch line is a `#pragma unroll 1` loop: two FFMAs an iteration */
    sass_profile prof = {loc, count, 6, NULL, 64, rolled};
    sass_cost c;

    th_begin("sass cost: each block's count times its instructions");
    TH_CHECK(sass_cost_function(sass, "k", &prof, &c) == 0, "function not found");
    /* 2 x 4 + 4 x 40 (the loop, all its trips) + 1 x 4 + 1 x 1 (the store: one warp) + 1 x 4; the self-branch 0 */
    TH_CHECK(c.executed == 177.0, "executed %.1f, expected 177", c.executed);
    TH_CHECK(c.instructions == 10 && c.blocks == 6 && c.blocks_run == 5, "instructions %d blocks %d run %d",
             c.instructions, c.blocks, c.blocks_run);
    th_end();

    th_begin("sass cost: a loop's count is its trips, not its lines' (the inline chain must match)");
    sass_loc other[6];
    memcpy(other, loc, sizeof other);
    other[1].line[1] = 13, other[2].line[1] = 13; /* the loop's lines reached through another call */
    sass_profile p2 = {other, count, 6, NULL, 64, rolled};
    TH_CHECK(sass_cost_function(sass, "k", &p2, &c) == 0, "function not found");
    /* the loop block has no known line: bounded by the flow (entry 4 + itself) -- not 40 */
    TH_CHECK(c.executed != 177.0, "an unmatched chain counted as matched");
    th_end();

    th_begin("sass cost: a line that starts an emulated block and is absent never ran");
    double c3[6] = {4, 40, 40, 4, 0, 4};
    sass_loc l3[5] = {{{10}, 1}, {{20, 12}, 2}, {{21, 12}, 2}, {{30}, 1}, {{40}, 1}};
    double k3[5] = {4, 40, 40, 4, 4};
    unsigned char bb[64] = {0};
    bb[31] = 1;
    sass_profile p3 = {l3, k3, 5, bb, 64, rolled};
    (void)c3;
    TH_CHECK(sass_cost_function(sass, "k", &p3, &c) == 0, "function not found");
    TH_CHECK(c.executed == 176.0, "executed %.1f, expected 176 (the store never ran)", c.executed);
    th_end();

    th_begin("sass cost: a loop the compiler unrolled runs once per copy set, not once per source trip");
    /* not `#pragma unroll 1`: line 20's two FFMAs are two copies of one source iteration, so the 40 trips the
     * profile counts are 20 SASS iterations */
    sass_profile p4 = {loc, count, 6, NULL, 0, NULL};
    TH_CHECK(sass_cost_function(sass, "k", &p4, &c) == 0, "function not found");
    TH_CHECK(c.executed == 97.0, "executed %.1f, expected 97 (8 + 4 x 20 + 4 + 1 + 4)", c.executed);
    th_end();

    th_begin("sass cost: the copies of one line's call in the branches of a dispatch share its count");
    {
        /* 4 warps, each runs copy A's loop 10 times (lines 20 and 21 inlined at 50: 40); copy B never runs, but
         * the lines cannot say which copy ran. Each copy at the full 40 (the model before the H200 check) is
         * 8 + 4 x 40 + 4 + 4 x 40 + 4 = 336; the truth is 8 + 4 x 40 + 4 + 0 + 4 = 176, what equal parts give */
        sass_loc la[5] = {{{10}, 1}, {{50}, 1}, {{20, 50}, 2}, {{21, 50}, 2}, {{40}, 1}};
        double ka[5] = {4, 4, 40, 40, 4};
        sass_profile pa = {la, ka, 5, NULL, 64, rolled};
        TH_CHECK(sass_cost_function(sass_alt, "k", &pa, &c) == 0, "function not found");
        TH_CHECK(c.executed == 176.0, "executed %.1f, expected 176 (each copy counted at the line's full count: 336)",
                 c.executed);
    }
    th_end();

    th_begin("sass cost: copies of an unrolled body in several blocks on one path share their line's count");
    {
        /* 4 warps, 10 trips each: line 60 ran 80 times (two copies a trip), 62 and 63 40. Each block at the
         * line's 80: 4 + 3 x 40 + 40 + 4 x 80 + 4 = 488, 344 after the flow (before); the truth
         * 4 + 120 + 40 + 160 + 4 = 328 */
        sass_loc ls[5] = {{{10}, 1}, {{60}, 1}, {{62}, 1}, {{63}, 1}, {{40}, 1}};
        double ks[5] = {4, 80, 40, 40, 4};
        sass_profile ps = {ls, ks, 5, NULL, 0, NULL};
        TH_CHECK(sass_cost_function(sass_seq, "k", &ps, &c) == 0, "function not found");
        TH_CHECK(c.executed == 328.0, "executed %.1f, expected 328 (before: 344)", c.executed);
    }
    th_end();

    th_begin("sass cost: a copy the flow finds dead leaves its line's count to the live one");
    {
        /* copy B starts with line 64, which never ran: copy A's loop ran all 40 trips. Equal parts (before):
         * 8 + 3 x 20 + 4 + 4 = 76; the truth 8 + 3 x 40 + 4 + 4 = 136 */
        sass_loc ld[5] = {{{10}, 1}, {{50}, 1}, {{20, 50}, 2}, {{21, 50}, 2}, {{40}, 1}};
        double kd[5] = {4, 4, 40, 40, 4};
        unsigned char bbd[80] = {0};
        bbd[64] = 2;
        sass_profile pd = {ld, kd, 5, bbd, 80, NULL};
        TH_CHECK(sass_cost_function(sass_dead, "k", &pd, &c) == 0, "function not found");
        TH_CHECK(c.executed == 136.0, "executed %.1f, expected 136 (equal parts: 76)", c.executed);
    }
    th_end();

    th_begin("sass cost: a line the profile holds under its chain with a call site left out did run");
    {
        /* the store's line 31 (inlined at 45, at 50) is in the profile only as (31, 50), a chain no instruction
         * has: the emulator profiles a function's last statement after a call into its headers without the
         * function's call site. It ran: its block is not zeroed as never run (before: 12; in the KIVI-2 kernel
         * the whole epilogue went with it through the flow) */
        sass_loc lt[4] = {{{10}, 1}, {{30}, 1}, {{31, 50}, 2}, {{40}, 1}};
        double kt[4] = {4, 4, 4, 4};
        unsigned char bbt[64] = {0};
        bbt[31] = 2;
        sass_profile pt = {lt, kt, 4, bbt, 64, NULL};
        TH_CHECK(sass_cost_function(sass_trunc, "k", &pt, &c) == 0, "function not found");
        TH_CHECK(c.executed == 16.0, "executed %.1f, expected 16 (the store's block zeroed: 12)", c.executed);
        /* the store labelled with its bare line 31 (ptxas left the call sites off: the decode epilogue's BSYNC of
         * `if (tx == 0)`) while the profile holds (31, 45, 50): it ran, its block is not zeroed */
        {
            static const char bare[] = "//--------------------- .text.k --------------------------\n"
                                       "\t.section\t.text.k,\"ax\",@progbits\n"
                                       ".text.k:\n" F(10) I("0000", "MOV R1, c[0x0][0x28]") F(30) I("0010", "@P1 BRA `(.L_x_2)")
                                       F(31) I("0020", "STG.E [R4.64], R3")
                                       ".L_x_2:\n" F(40) I("0030", "EXIT")
                                       "\t.section\t.text.other,\"ax\",@progbits\n";
            sass_loc lb[4] = {{{10}, 1}, {{30}, 1}, {{31, 45, 50}, 3}, {{40}, 1}};
            sass_profile pb = {lb, kt, 4, bbt, 64, NULL};
            TH_CHECK(sass_cost_function(bare, "k", &pb, &c) == 0, "function not found");
            TH_CHECK(c.executed == 16.0, "executed %.1f, expected 16 (a bare line's block zeroed: 12)", c.executed);
        }
        /* held nowhere: it never ran */
        lt[2] = (sass_loc){{41}, 1};
        TH_CHECK(sass_cost_function(sass_trunc, "k", &pt, &c) == 0, "function not found");
        TH_CHECK(c.executed == 12.0, "executed %.1f, expected 12 (line 31 never ran)", c.executed);
    }
    th_end();

    th_begin("sass cost: code two sibling calls share counts the runs of the call ptxas did not name");
    {
        /* the store (line 31 inlined at 45, at 50) is one copy for the calls at lines 45 and 46 (ptxas named 45),
         * and only the call at 46 ran it: the profile holds (31, 46, 50), a chain no instruction has. It ran (4
         * warps): 16, where "never ran" gave 12 (KIVI-2's value parameters, staged through kvq_stage_tile's second
         * call and labelled with its first: 1,243 instructions counted 0, ncu run 7) */
        sass_loc ls[5] = {{{10}, 1}, {{30}, 1}, {{31, 46, 50}, 3}, {{40}, 1}, {{31, 47, 50}, 3}};
        double ks[5] = {4, 4, 4, 4, 4};
        unsigned char bbs[64] = {0};
        bbs[31] = 2;
        sass_profile ps = {ls, ks, 4, bbs, 64, NULL};
        TH_CHECK(sass_cost_function(sass_trunc, "k", &ps, &c) == 0, "function not found");
        TH_CHECK(c.executed == 16.0, "executed %.1f, expected 16 (never ran: 12)", c.executed);
        TH_CHECK(c.instr_run == 4, "%d instructions run, expected all 4", c.instr_run);
        /* two such chains: one of them is this copy's (separate copies each named after a third call), not both */
        ps.n = 5;
        TH_CHECK(sass_cost_function(sass_trunc, "k", &ps, &c) == 0, "function not found");
        TH_CHECK(c.executed == 16.0, "executed %.1f, expected 16 (the sum: 20)", c.executed);
        /* the named call ran it too (2 warps): its own count is this code's, 4 + 4 + 2 + 4 */
        ls[4] = (sass_loc){{31, 45, 50}, 3}, ks[4] = 2;
        TH_CHECK(sass_cost_function(sass_trunc, "k", &ps, &c) == 0, "function not found");
        TH_CHECK(c.executed == 14.0, "executed %.1f, expected 14 (the sibling's count: 16)", c.executed);
        /* a chain two call sites away (the outermost differs) says nothing: never ran */
        ls[2] = (sass_loc){{31, 46, 51}, 3}, ps.n = 4;
        TH_CHECK(sass_cost_function(sass_trunc, "k", &ps, &c) == 0, "function not found");
        TH_CHECK(c.executed == 12.0, "executed %.1f, expected 12 (line 31 never ran)", c.executed);
        TH_CHECK(c.instr_run == 3, "%d instructions run, expected 3 (not the store)", c.instr_run);
    }
    th_end();

    th_begin("sass cost: an entry line ptxas recomputes inside a loop does not bound the loop's count");
    {
        /* 2 x 4 (entry) + 6 x 40 (the loop with its S2R and LOP3 of line 10, counted 4) + 1 x 4 (exit) = 252; the
         * least count of the loop block's lines (4) gave 2 x 4 + 6 x 4 + 4 = 36 */
        sass_loc lr[4] = {{{10}, 1}, {{20, 12}, 2}, {{21, 12}, 2}, {{40}, 1}};
        double kr[4] = {4, 40, 40, 4};
        sass_profile pr = {lr, kr, 4, NULL, 64, rolled};
        TH_CHECK(sass_cost_function(sass_remat, "k", &pr, &c) == 0, "function not found");
        TH_CHECK(c.executed == 252.0, "executed %.1f, expected 252 (the entry's count: 36)", c.executed);
    }
    th_end();

    th_begin("sass cost: a condition's comparison and branch run as often as their block, not as its body");
    {
        /* 4 warps, 10 trips each: the `continue` (line 70's emulated block) ran 8 times, the store 32. The block of
         * lines 71 and 70 runs every trip: 4 + 3 x 40 + 32 + 2 x 40 + 4 = 240; line 70's 8 bounding it gave
         * 4 + 3 x 8 + ... (KIVI-2's bias partials: 96 counted where ncu ran 2,128) */
        sass_loc lc[6] = {{{10}, 1}, {{70}, 1}, {{71}, 1}, {{72}, 1}, {{73}, 1}, {{40}, 1}};
        double kc[6] = {4, 8, 40, 32, 40, 4};
        unsigned char bbc[80] = {0};
        bbc[70] = 3, bbc[71] = 2, bbc[72] = 2, bbc[73] = 1; /* 70: an if, 73: a loop's condition */
        sass_profile pc = {lc, kc, 6, bbc, 80, NULL};
        TH_CHECK(sass_cost_function(sass_cond, "k", &pc, &c) == 0, "function not found");
        TH_CHECK(c.executed == 240.0, "executed %.1f, expected 240", c.executed);
    }
    th_end();

    th_begin("sass cost: a function not in the text");
    TH_CHECK(sass_cost_function(sass, "nope", &prof, &c) == 1, "found a missing function");
    th_end();
    return th_summary();
}
