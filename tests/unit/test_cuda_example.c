/* docs/example_device.c, the device-tensor example (docs/cuda.md "Device tensors"), compiled into this test and
 * run on the emu backend for a spec of each policy: its own check (the device path's outputs equal the
 * host-pointer path's, bit for bit, layer by layer over the steps) must pass. */
#define main example_main
#include "../../docs/example_device.c"
#undef main

#include "harness.h"

int main(void)
{
    const char *specs[] = {"specs/kivi2.kvq", "specs/ott.kvq", "specs/zipcache.kvq", "specs/tailorkv1.kvq"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        th_begin("docs/example_device.c on the emu backend with %s: a small model's attention layer by layer with "
                 "device tensors on a stream, equal to the host path",
                 specs[i]);
        char path[1024];
        snprintf(path, sizeof path, "%s", th_path(specs[i]));
        char *argv[] = {"example_device", path, "emu", NULL};
        TH_CHECK(example_main(3, argv) == 0, "the example failed");
        th_end();
    }
    return th_summary();
}
