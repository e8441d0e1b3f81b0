/* Status plus message for calls that report into a caller's buffer (kvq_engine_create's errbuf,
 * kvq_scheme_check_dims's msg): one formatter instead of one per file. */
#ifndef KVQ_STATUS_H
#define KVQ_STATUS_H

#include <stddef.h>

#include "kvq.h"

/* Formats the message into buf (if buf and size) and returns st. */
kvq_status kvq_status_msg(char *buf, size_t size, kvq_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
