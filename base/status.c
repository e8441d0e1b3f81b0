#include "status.h"

#include <stdarg.h>
#include <stdio.h>

const char *kvq_status_str(kvq_status s)
{
    switch (s) {
    case KVQ_OK: return "ok";
    case KVQ_ERR_SPEC: return "the spec has errors";
    case KVQ_ERR_INVALID: return "invalid argument";
    case KVQ_ERR_SHAPE: return "shape mismatch";
    case KVQ_ERR_NOMEM: return "out of memory";
    case KVQ_ERR_IO: return "input/output error";
    case KVQ_ERR_FORMAT: return "malformed file";
    case KVQ_ERR_UNAVAILABLE: return "unavailable";
    case KVQ_ERR_UNSUPPORTED: return "unsupported";
    case KVQ_ERR_STATE: return "invalid state";
    case KVQ_ERR_INTERNAL: return "internal error";
    }
    return "unknown status";
}

kvq_status kvq_status_msg(char *buf, size_t size, kvq_status st, const char *fmt, ...)
{
    if (buf && size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(buf, size, fmt, ap);
        va_end(ap);
    }
    return st;
}
