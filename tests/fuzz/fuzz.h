/* The fuzz targets (tests/fuzz/fuzz_*.c): each defines libFuzzer's entry point. `make fuzz` links them with
 * libFuzzer (clang -fsanitize=fuzzer); `make test` links them with tests/fuzz/replay.c, a plain-C driver that
 * replays the seed corpus and mutates it for a few seconds. docs/testing.md says how to run them for hours. */
#ifndef KVQ_FUZZ_H
#define KVQ_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The target's name for the replay driver ("spec", "npy", "engine"): its corpus is tests/fuzz/corpus/NAME. */
extern const char fuzz_target_name[];

/* An invariant the target checks: on failure, say which and abort (libFuzzer saves the input as a crash). */
#define FUZZ_CHECK(cond, ...)                                                                                  \
    do {                                                                                                       \
        if (!(cond)) {                                                                                         \
            fprintf(stderr, "fuzz invariant failed at %s:%d: ", __FILE__, __LINE__);                           \
            fprintf(stderr, __VA_ARGS__);                                                                      \
            fputc('\n', stderr);                                                                               \
            abort();                                                                                           \
        }                                                                                                      \
    } while (0)

#endif
