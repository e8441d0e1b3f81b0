/* kvqc: the compile-side tool. Dispatches to one subcommand per file (kvqc.h); each gets argv with argv[0] set
 * to the subcommand's name. */
#include <stdio.h>
#include <string.h>

#include "kvq.h"
#include "kvqc.h"

static void usage(FILE *to)
{
    fprintf(to,
            "usage: kvqc COMMAND [ARGS]\n"
            "  check FILE...     check specs: diagnostics on stderr, 'FILE: ok (...)' on stdout\n"
            "  report FILE ...   memory by segment, effective bits and compression ratio (kvqc report --help)\n"
            "  build FILE ...    CUDA kernels ahead of time into generated/<scheme>/ (kvqc build --help)\n"
            "  --version         kvq's version\n"
            "exit status: 0 ok, 1 a spec has errors, 2 usage error\n");
}

int main(int argc, char **argv)
{
    const char *cmd = argc > 1 ? argv[1] : NULL;
    if (!cmd) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "--version")) {
        printf("kvqc %s\n", kvq_version());
        return 0;
    }
    if (!strcmp(cmd, "check")) return kvqc_check_main(argc - 1, argv + 1);
    if (!strcmp(cmd, "report")) return kvqc_report_main(argc - 1, argv + 1);
    if (!strcmp(cmd, "build")) return kvqc_build_main(argc - 1, argv + 1);
    fprintf(stderr, "kvqc: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
