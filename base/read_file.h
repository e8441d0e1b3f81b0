/* Reading a whole file into memory (the prebuilt kernels of generated/ and their manifests). */
#ifndef KVQ_READ_FILE_H
#define KVQ_READ_FILE_H

#include <stddef.h>

/* The whole file at path, NUL-terminated (kvq_malloc'd, *size without the NUL), or NULL when it cannot be opened
 * or read, or memory runs out. */
char *kvq_read_file(const char *path, size_t *size);

#endif
