# `make gpu-bundle`: one folder (GPU_BUNDLE, at most 40 MiB) holding what a GPU machine needs to check kvq with no
# compiler, no LLVM, no flex/bison and no network (docs/gpu.md): the GPU test programs (tests/gpu/*), the decode
# benchmark, the kvq and kvqc tools, all built without LLVM in their own build folder (GPU_BUNDLE_BUILD); the data
# the runtime reads (specs/, generated/ with its cubins for sm_80 and sm_90, templates/, the emulator's sources
# under share/kvq as `make install` lays them out); the NVRTC cache pre-filled for sm_90 and sm_80 by running the
# GPU tests against the recording fake driver (tests/fakecuda) that reports that sm; and tools/gpu-check.sh.
# GPU_BUNDLE_PREFILL=0 skips the cache and the generated/ cubins (the dry-run test, tests/sh/test_gpu_bundle.sh).
# Included from the top-level Makefile.
GPU_BUNDLE ?= build/gpu-bundle
GPU_BUNDLE_BUILD ?= build/gpu-nollvm
GPU_BUNDLE_PREFILL ?= 1
.PHONY: gpu-bundle gpu-bundle-bins
# The binaries: a sub-make with LLVM_CONFIG empty (the cpu backend compiles without LLVM and reports itself
# unavailable) and CI unset (cpu.mk refuses a build without LLVM under CI=true, rightly for `make test`).
gpu-bundle:
	@$(MAKE) --no-print-directory BUILD=$(GPU_BUNDLE_BUILD) SAN=0 LLVM_CONFIG= CI= gpu-bundle-bins
	@sh tools/gpu-bundle.sh $(GPU_BUNDLE_BUILD) $(GPU_BUNDLE) $(GPU_BUNDLE_PREFILL)
gpu-bundle-bins: $(BUILD)/kvq $(BUILD)/kvqc $(GPU_TEST_BIN) $(BENCH_GPU) $(FAKECUDA_SO)

# `make gpu-ab GPU_AB="base=REV new=."`: the decode benchmark of several revisions (or the checkout as it is, ".")
# with their NVRTC caches, for one GPU machine to time them in one call (tools/gpu-ab.sh, docs/gpu.md "Same
# machine, several builds"): build/gpu-ab/ab.sh there.
GPU_AB ?= base=HEAD new=.
GPU_AB_OUT ?= build/gpu-ab
.PHONY: gpu-ab
gpu-ab:
	@sh tools/gpu-ab.sh $(GPU_AB_OUT) $(GPU_AB)
