/* NumPy .npy files: how K/V/Q tensors come into and go out of kvq (DESIGN.md section 8). Internal to the
 * runtime and its tools; docs/npy.md describes what is accepted for users.
 *
 * Read: format versions 1.0, 2.0 and 3.0; C order only; dtypes float32 ('<f4', '>f4'), float16 ('<f2', '>f2')
 * and bfloat16 as ml_dtypes saves it ('<V2': NumPy has no bfloat16, so np.save records ml_dtypes' type as raw
 * little-endian 2-byte data). Big-endian data is converted. Every element is widened to float32 (exactly: fp16
 * and bf16 values are all representable) and the file's dtype is recorded.
 * Write: format version 1.0 (a header for at most 8 dimensions never needs 2.0's longer length field), data
 * little-endian, converted from float32 with round-to-nearest-even (base/half.h).
 *
 * Errors come back as a status and a message "<path>: <problem>" in the caller's buffer: KVQ_ERR_IO when the
 * file cannot be opened, read or written, KVQ_ERR_FORMAT when its contents are malformed or unsupported,
 * KVQ_ERR_NOMEM when an allocation fails, KVQ_ERR_INVALID for bad arguments. */
#ifndef KVQ_NPY_H
#define KVQ_NPY_H

#include <stddef.h>

#include "kvq.h"

#define KVQ_NPY_MAX_DIMS 8

typedef struct {
    kvq_dtype dtype;                /* the element type stored in the file (kvq.h) */
    int ndim;                       /* 0 (a scalar) to KVQ_NPY_MAX_DIMS */
    size_t shape[KVQ_NPY_MAX_DIMS]; /* the first ndim are set */
    size_t count;                   /* product of the shape (1 for a scalar) */
    float *data;                    /* count values, C order; kvq_malloc'd, freed by kvq_npy_free */
} kvq_npy;

/* "float32", "float16", "bfloat16"; NULL for a value outside kvq_dtype. In a file they are '<f4', '<f2' and
 * '<V2' (ml_dtypes.bfloat16). */
const char *kvq_npy_dtype_name(kvq_dtype dtype);

/* Reads the whole file. *out is always initialised: on failure it holds no data and kvq_npy_free is a no-op.
 * err (errsz bytes, may be NULL/0) receives the message on failure. */
kvq_status kvq_npy_read(const char *path, kvq_npy *out, char *err, size_t errsz);

/* Reads and checks only the header (and, for a regular file, that its size matches the header): dtype, ndim,
 * shape and count are set, data is NULL. For comparing shapes before any data is read. */
kvq_status kvq_npy_read_header(const char *path, kvq_npy *out, char *err, size_t errsz);

/* Writes data (count = product of shape floats, C order) as dtype, replacing the file. ndim may be 0 (a
 * scalar: one value). On failure the partly written file is removed. */
kvq_status kvq_npy_write(const char *path, kvq_dtype dtype, const size_t *shape, int ndim, const float *data,
                         char *err, size_t errsz);

/* Frees the data and resets *a; NULL is fine. */
void kvq_npy_free(kvq_npy *a);

#endif
