#include "read_file.h"

#include <stdio.h>
#include <string.h>

#include "alloc.h"

char *kvq_read_file(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0, k;
    char tmp[65536];
    while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) {
        if (len + k + 1 > cap) {
            cap = (len + k + 1) * 2;
            char *t = kvq_realloc(buf, cap);
            if (!t) {
                kvq_free(buf);
                fclose(f);
                return NULL;
            }
            buf = t;
        }
        memcpy(buf + len, tmp, k);
        len += k;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        kvq_free(buf);
        return NULL;
    }
    if (!buf) buf = kvq_calloc(1, 1);
    if (buf) buf[len] = 0;
    *size = len;
    return buf;
}
