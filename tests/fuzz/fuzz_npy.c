/* Fuzz target: the .npy reader, with a write-back round trip. The input is a file's bytes: it is read (header
 * only, then whole). Invariants: the two reads agree on dtype and shape; a file read with KVQ_OK writes back
 * (same dtype and shape) and reads back to the same values bit for bit (NaN as NaN: NaN payloads are not kept);
 * a failed read leaves no data and a message naming the file. */
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "fuzz.h"
#include "npy.h"

const char fuzz_target_name[] = "npy";

static char in_path[64], out_path[64];

static void remove_files(void)
{
    unlink(in_path);
    unlink(out_path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!in_path[0]) {
        snprintf(in_path, sizeof in_path, "/tmp/kvq_fuzz_npy_%d.npy", (int)getpid());
        snprintf(out_path, sizeof out_path, "/tmp/kvq_fuzz_npy_%d.out.npy", (int)getpid());
        atexit(remove_files);
    }
    FILE *f = fopen(in_path, "wb");
    if (!f) return 0;
    size_t w = fwrite(data, 1, size, f);
    if (fclose(f) != 0 || w != size) return 0;

    kvq_npy h, a, b;
    char err[512];
    kvq_status sh = kvq_npy_read_header(in_path, &h, err, sizeof err);
    kvq_status sa = kvq_npy_read(in_path, &a, err, sizeof err);
    if (sa != KVQ_OK) {
        FUZZ_CHECK(a.data == NULL && a.count == 0, "a failed read left data");
        FUZZ_CHECK(strncmp(err, in_path, strlen(in_path)) == 0, "message does not name the file: %s", err);
        return 0;
    }
    FUZZ_CHECK(sh == KVQ_OK && h.data == NULL, "header read %d where the full read succeeded", (int)sh);
    FUZZ_CHECK(h.dtype == a.dtype && h.ndim == a.ndim && h.count == a.count &&
                   !memcmp(h.shape, a.shape, sizeof h.shape),
               "header and data reads disagree");
    kvq_status sw = kvq_npy_write(out_path, a.dtype, a.shape, a.ndim, a.data, err, sizeof err);
    FUZZ_CHECK(sw == KVQ_OK, "write-back failed: %s", err);
    kvq_status sb = kvq_npy_read(out_path, &b, err, sizeof err);
    FUZZ_CHECK(sb == KVQ_OK, "reading the written file failed: %s", err);
    FUZZ_CHECK(b.dtype == a.dtype && b.ndim == a.ndim && b.count == a.count && !memcmp(b.shape, a.shape, sizeof a.shape),
               "round trip changed dtype or shape");
    for (size_t i = 0; i < a.count; i++)
        FUZZ_CHECK((isnan(a.data[i]) && isnan(b.data[i])) || !memcmp(&a.data[i], &b.data[i], sizeof(float)),
                   "round trip changed value %zu: %g -> %g", i, (double)a.data[i], (double)b.data[i]);
    kvq_npy_free(&a);
    kvq_npy_free(&b);
    return 0;
}
