/* kvq: the runtime-side tool. `kvq eval` measures what schemes lose on K/V/Q tensors, `kvq bench` how fast their
 * decode runs, `kvq membw` the machine's read bandwidth that bench compares against. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvq_tool.h"

int kvq_tool_error(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "kvq %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return -1;
}

static void usage(void)
{
    fprintf(stderr, "usage: kvq eval FILE... [options]    accuracy of schemes   (kvq eval --help for the options)\n"
                    "       kvq bench FILE... [options]   decode speed          (kvq bench --help)\n"
                    "       kvq membw [options]           read bandwidth        (kvq membw --help)\n"
                    "       kvq --version\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage();
        return 2;
    }
    if (!strcmp(argv[1], "eval")) return kvq_eval_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "bench")) return kvq_bench_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "membw")) return kvq_membw_main(argc - 1, argv + 1);
    if (!strcmp(argv[1], "--version")) {
        printf("kvq %s\n", kvq_version());
        return 0;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage();
        return 0;
    }
    fprintf(stderr, "kvq: unknown command '%s'\n", argv[1]);
    usage();
    return 2;
}
