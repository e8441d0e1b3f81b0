/* The loaded library's version (kvq.h's KVQ_VERSION when it was built). */
#include "kvq.h"

const char *kvq_version(void) { return KVQ_VERSION; }
