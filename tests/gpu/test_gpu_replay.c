/* On a real GPU: planned decode steps captured with the driver's stream capture and replayed with cuGraphLaunch
 * (tests/unit/test_cuda_replay.c built for KVQ_BACKEND_CUDA): every step's outputs, the caches and the statistics
 * equal the host-pointer path's bit for bit, a replayed step makes one H2D copy and no synchronisation,
 * allocation, D2H copy or launch by the host. Without a CUDA driver or GPU it prints "SKIP" and exits 0. Run with
 * `make gpu-test`. */
#define CU_TEST_BACKEND KVQ_BACKEND_CUDA
#include "../unit/test_cuda_replay.c"
