# The CUDA side of kvq (docs/cuda.md): templates embedded in libkvq, the cuda/emu backends in runtime/cuda/,
# kvqc build's generated/ tree, and the kernel tests. Included from the top-level Makefile.

CUDA_TEMPLATES := $(sort $(wildcard templates/*.cuh))
$(GEN)/kvq_templates.c: $(CUDA_TEMPLATES) compiler/embed_templates.sh
	@mkdir -p $(GEN)
	sh compiler/embed_templates.sh $(CUDA_TEMPLATES) > $@.tmp && mv $@.tmp $@

CUDA_LIB_OBJ := $(BUILD)/obj/gen/kvq_templates.o $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard runtime/cuda/*.c))
$(LIB): $(CUDA_LIB_OBJ)
INCLUDES += -Itemplates
# The emulator device finds tests/emu and generated/ here unless $KVQ_SRCDIR says otherwise.
$(BUILD)/obj/runtime/cuda/%.o: CFLAGS += -DKVQ_SOURCE_DIR='"$(CURDIR)"'

# generated/: the text part (kernels.cu, kernels.h, manifest.json, resources.txt) is committed; cubins and PTX
# (git-ignored) are built beside it. tests/unit/test_cuda_generated.c fails when the committed text is stale.
GEN_SPECS := $(sort $(wildcard specs/*.kvq specs/paper/*.kvq))
# kvqc build --cost (the cost model) reads the SASS with nvdisasm, which NVRTC's toolkit lacks: PyPI's wheels go
# into a virtual environment under build/ (tools/ensure-sass-tools.sh; without Python or network --cost refuses).
.PHONY: generated sass-tools
sass-tools:
	@sh tools/ensure-sass-tools.sh build
generated: $(BUILD)/kvqc sass-tools
	@for f in $(GEN_SPECS); do $(BUILD)/kvqc build $$f --arch sm_80,sm_90 -o generated || exit 1; done

# tests/gpu and bench/gpu: built with everything (so they keep compiling), run on a machine with a GPU by
# `make gpu-test` / `make bench-gpu`; without one they print "skipped: <reason>" and exit 0.
GPU_TEST_BIN := $(patsubst tests/gpu/%.c,$(BUILD)/gpu/%,$(wildcard tests/gpu/test_*.c))
BENCH_GPU := $(BUILD)/bench/bench_gpu_decode
# their dependency files (a GPU test includes a unit test's source: a change there rebuilds it)
-include $(GPU_TEST_BIN:=.d)
$(BUILD)/gpu/%: tests/gpu/%.c $(BUILD)/obj/tests/harness.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(BUILD)/obj/tests/harness.o $(LIB) $(LDLIBS_ALL)
$(BENCH_GPU): bench/gpu/bench_decode.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIB) $(LDLIBS_ALL)
EXTRA_ALL += $(GPU_TEST_BIN) $(BENCH_GPU)
.PHONY: gpu-test bench-gpu
gpu-test: $(GPU_TEST_BIN)
	@for t in $(GPU_TEST_BIN); do KVQ_SRCDIR=$(CURDIR) $$t || exit 1; done
bench-gpu: $(BENCH_GPU)
	@$(BENCH_GPU)
