/* On a real GPU: TurboQuant on the cuda backend against the reference backend (tests/unit/test_cuda_turboquant.c
 * built for KVQ_BACKEND_CUDA): every scheme of specs/rotate/turboquant*.kvq, decode outputs within 1e-3, read_cache
 * bit-identical (the quantize kernels' codes, norms and QJL signs), statistics identical. Without a CUDA driver or
 * GPU it prints "skipped: <reason>" and exits 0 (no PASS). Run with `make gpu-test`. */
#define CU_TEST_BACKEND KVQ_BACKEND_CUDA
#include "../unit/test_cuda_turboquant.c"
