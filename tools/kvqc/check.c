/* kvqc check [--target cuda [--arch sm_80,sm_90] [--heads H] [--kv-heads HKV] [--head-dim D]] FILE...: parse
 * and resolve each spec, print its diagnostics (with the source line and a caret) on stderr, and
 * "FILE: ok (N schemes: a, b)" on stdout for each spec without errors. With --target cuda, each scheme's kernel
 * plan is also built at the scheme's dims (model { }, the options, else the defaults) and checked against each
 * arch's limits (shared memory, threads, registers: plan_check_target); a scheme that does not fit is an error
 * with the reason. Exit 1 if any spec has an error (or cannot be read), 2 on a usage error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq.h"
#include "kvqc.h"
#include "plan.h"
#include "tool_spec.h"

#define CHECK_USAGE "usage: kvqc check [--target cuda [--arch sm_80,sm_90] [--heads H] [--kv-heads HKV] [--head-dim D]] FILE...\n"

/* Every scheme of spec against every arch; 0 when all fit. */
static int check_cuda(const char *file, const kvq_spec *spec, const int *sms, int n_sms, const kvq_dims *dims0)
{
    int bad = 0;
    kvq_plan *p = malloc(sizeof *p);
    if (!p) return 1;
    for (int i = 0; i < kvq_spec_scheme_count(spec); i++) {
        const kvq_scheme *s = kvq_spec_scheme_at(spec, i);
        kvq_dims d = *dims0;
        plan_default_dims(s, &d);
        char msg[512], where[16] = "";
        kvq_status st = plan_build(s, &d, KVQ_F32, p, msg, sizeof msg);
        for (int a = 0; a < n_sms && st == KVQ_OK; a++) {
            st = plan_check_target(p, sms[a], msg, sizeof msg);
            if (st != KVQ_OK) snprintf(where, sizeof where, "sm_%d: ", sms[a]);
        }
        if (st != KVQ_OK) {
            fprintf(stderr, "%s: error: scheme '%s' does not fit the cuda target at %d heads / %d kv heads, head_dim "
                    "%d: %s%s\n", file, kvq_scheme_name(s), d.heads, d.kv_heads, d.head_dim, where, msg);
            bad = 1;
        }
    }
    free(p);
    return bad;
}

int kvqc_check_main(int argc, char **argv)
{
    int files = 0, failed = 0, cuda = 0, sms[8] = {80, 90}, n_sms = 2;
    kvq_dims dims = {0};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            printf(CHECK_USAGE);
            return 0;
        }
        if (!strcmp(o, "--target") && v) {
            if (strcmp(v, "cuda")) {
                fprintf(stderr, "kvqc check: unknown target '%s' (cuda)\n", v);
                return 2;
            }
            cuda = 1, argv[i] = argv[i + 1] = NULL, i++;
        } else if (!strcmp(o, "--arch") && v) {
            char buf[128];
            snprintf(buf, sizeof buf, "%s", v);
            n_sms = 0;
            for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                if (n_sms == 8 || strncmp(t, "sm_", 3) || atoi(t + 3) < 80) {
                    fprintf(stderr, "kvqc check: bad architecture '%s' (sm_80 or newer)\n", t);
                    return 2;
                }
                sms[n_sms++] = atoi(t + 3);
            }
            argv[i] = argv[i + 1] = NULL, i++;
        } else if ((!strcmp(o, "--heads") || !strcmp(o, "--kv-heads") || !strcmp(o, "--head-dim")) && v) {
            int x = atoi(v);
            if (x < 1 || x > 65536) {
                fprintf(stderr, "kvqc check: %s expects a positive integer, got '%s'\n", o, v);
                return 2;
            }
            *(!strcmp(o, "--heads") ? &dims.heads : !strcmp(o, "--kv-heads") ? &dims.kv_heads : &dims.head_dim) = x;
            argv[i] = argv[i + 1] = NULL, i++;
        } else if (o[0] == '-' && o[1]) {
            fprintf(stderr, "kvqc check: unknown option '%s'\n" CHECK_USAGE, o);
            return 2;
        }
    }
    for (int i = 1; i < argc; i++) {
        if (!argv[i]) continue;
        kvq_spec *spec = NULL;
        kvq_status st = kvq_spec_parse_file(argv[i], &spec);
        files++;
        if (!spec) {
            fprintf(stderr, "kvqc check: %s: %s\n", argv[i], kvq_status_str(st));
            failed++;
            continue;
        }
        tool_print_diagnostics(spec);
        if (st == KVQ_OK && cuda && check_cuda(argv[i], spec, sms, n_sms, &dims)) st = KVQ_ERR_UNSUPPORTED;
        if (st != KVQ_OK) {
            failed++;
        } else {
            int n = kvq_spec_scheme_count(spec);
            printf("%s: ok (%d scheme%s", argv[i], n, n == 1 ? "" : "s");
            for (int k = 0; k < n; k++)
                printf("%s%s", k == 0 ? ": " : ", ", kvq_scheme_name(kvq_spec_scheme_at(spec, k)));
            printf(")\n");
        }
        kvq_spec_free(spec);
    }
    if (files == 0) {
        fprintf(stderr, CHECK_USAGE);
        return 2;
    }
    fflush(stdout);
    return failed ? 1 : 0;
}
