/* What the device layer did, for tests (not part of kvq.h): counters of every driver call a serving step must
 * not make, and the emulated device's capture mode. Process-wide, like cu_dev_fail_after.
 *
 * Counted by the device front (cu_dev.c) for every device, GPU or emulator:
 * - syncs: cu_dev_sync (cuStreamSynchronize), each synchronous copy (cu_dev_h2d / cu_dev_d2h: async + sync), and
 *   each async copy whose host side is pageable (the driver makes it synchronous);
 * - allocs / frees: cuMemAlloc / cuMemFree; host_allocs / host_frees: cuMemHostAlloc / cuMemFreeHost;
 * - h2d / d2h: copies of either kind, each way; memsets; launches; module loads;
 * - h2d_bytes: the bytes of the h2d copies (a planned step's one upload: bounded by the batch and the layers, not
 *   by the context, docs/cuda.md "Planned steps").
 *
 * Capture mode (cu_dev_capture(1)) models CUDA stream capture (cuStreamBeginCapture in the global mode) on the
 * emulated device: every call a capture refuses fails with KVQ_ERR_INTERNAL and a message naming the call and
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, without doing anything: synchronisations and synchronous copies,
 * allocations and frees (device and page-locked), module loads and attribute changes, and async copies whose
 * host side is pageable. Launches, async copies between the device and page-locked memory, and memsets on the
 * stream are what a graph records; in capture they still run at once (the emulator executes eagerly) and are
 * recorded (below). The refusals are counted in capture_refused. A GPU's driver enforces the same by itself. */
#ifndef KVQ_CU_COUNTERS_H
#define KVQ_CU_COUNTERS_H

#include <stddef.h>

#include "kvq.h"

typedef struct {
    long syncs, allocs, frees, host_allocs, host_frees, h2d, d2h, memsets, launches, loads;
    long capture_refused;
    long replays, replayed_nodes; /* cu_dev_graph_replay calls, and the nodes they ran (not counted above) */
    long event_waits;             /* cuEventSynchronize: the host waits for the stream up to an event */
    long h2d_bytes;               /* bytes of the h2d copies */
} cu_dev_counters;

void cu_dev_counters_get(cu_dev_counters *out);
/* d = a - b, field by field. */
void cu_dev_counters_diff(const cu_dev_counters *a, const cu_dev_counters *b, cu_dev_counters *d);
/* On (1) or off (0); affects emulated devices only. Turning it on starts a new recorded graph (below). */
void cu_dev_capture(int on);
int cu_dev_capturing(void);

/* The emulated graph. In capture mode an emulated device also records every call it allows, in order, as
 * cuStreamEndCapture would turn them into graph nodes: a launch (kernel, grid, block, dynamic shared memory and a
 * copy of the parameter bytes), an async copy between the device and page-locked host memory (the host address,
 * read or written when the node runs, as a graph's memcpy node does), a memset. cu_dev_graph_replay runs the
 * recorded nodes again, in order, as cuGraphLaunch would (each on its device, outside capture); the replays are
 * counted in replays / replayed_nodes and not as launches or copies, so a test sees what the host did beside the
 * graph. The graph is dropped at the next cu_dev_capture(1), by cu_dev_graph_reset, and when a device it runs
 * on is closed. Process-wide like capture mode; for tests, one thread. */
kvq_status cu_dev_graph_replay(char *msg, size_t n);
int cu_dev_graph_nodes(void);
void cu_dev_graph_reset(void);

#endif
