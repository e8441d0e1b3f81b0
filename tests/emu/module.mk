# The SIMT emulator (tests/emu): its runtime, its test kernels (CUDA C compiled by the host C++ compiler) and
# its test programs, which join TEST_BIN as $(BUILD)/tests/test_emu_*. Nothing here depends on libkvq or the
# generated parser, so the emulator builds and tests on its own. `make emu-test` builds without sanitizers into
# build/, runs only these tests and ends with the measured barrier-crossing rate.

EMU_DIR := tests/emu
EMU_OBJ := $(BUILD)/obj/tests/emu
EMU_RT_OBJ := $(patsubst %,$(EMU_OBJ)/%.o,exec warp cp_async fiber)
# The same runtime with the portable ucontext switch, so that fallback is tested too.
EMU_RT_UC_OBJ := $(patsubst %,$(EMU_OBJ)/uc/%.o,exec warp cp_async fiber)
EMU_HARNESS := $(EMU_OBJ)/harness.o
EMU_INC := -I$(EMU_DIR) -I$(EMU_DIR)/kernels -Itemplates
# Kernel sources are C++ for the host compiler; no exceptions or RTTI, as on the GPU. CUDA's `#pragma unroll`
# means nothing to g++ (and GCC 12 cannot silence it from a header).
EMU_CXXFLAGS = -std=c++14 -g -O2 -ffp-contract=off -Wall -Wextra -Werror -Wno-unknown-pragmas -MMD -MP \
	-fno-exceptions -fno-rtti $(SANFLAGS) $(EMU_INC) $(CXXFLAGS)
EMU_CFLAGS = $(CFLAGS_ALL) $(EMU_INC)

$(EMU_OBJ)/%.o: $(EMU_DIR)/%.c
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -c $< -o $@
$(EMU_OBJ)/uc/%.o: $(EMU_DIR)/%.c
	@mkdir -p $(dir $@)
	$(CC) $(EMU_CFLAGS) -DEMU_FIBER_UCONTEXT -c $< -o $@
$(EMU_OBJ)/kernels/%.o: $(EMU_DIR)/kernels/%.cu
	@mkdir -p $(dir $@)
	$(CXX) $(EMU_CXXFLAGS) -x c++ -c $< -o $@
$(EMU_HARNESS): tests/harness.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -c $< -o $@

# test program -> the kernel files it launches
EMU_TEST_KERNELS_block := reduce
EMU_TEST_KERNELS_ucontext := reduce warp
EMU_TEST_KERNELS_warp := warp
EMU_TEST_KERNELS_async := matmul
EMU_TEST_KERNELS_half := half
EMU_TEST_KERNELS_bugs := bugs
EMU_TEST_KERNELS_intrin := intrin
EMU_TEST_KERNELS_unpack := unpack
EMU_TEST_KERNELS_mma := mma
# the device element formats against runtime/quant.c and base/minifloat.c (their objects linked in)
EMU_TEST_KERNELS_format := format
EMU_TEST_EXTRA_OBJ_format := $(patsubst %,$(BUILD)/obj/%.o,runtime/quant base/minifloat base/half base/lloyd_max)
EMU_TEST_KERNELS_nvrtc :=
EMU_TEST_KERNELS_dlopen :=
EMU_TESTS := block ucontext warp async half bugs intrin unpack mma format nvrtc dlopen

# A kernel built as a shared object, for the dlopen convention; its host exports the runtime with -rdynamic.
EMU_SO := $(BUILD)/tests/emu_kernels/warp.so
$(EMU_SO): $(EMU_DIR)/kernels/warp.cu
	@mkdir -p $(dir $@) $(EMU_OBJ)/kernels
	$(CXX) $(EMU_CXXFLAGS) -MF $(EMU_OBJ)/kernels/warp.so.d -fPIC -shared -x c++ $< -o $@
EMU_TEST_EXTRA_dlopen := -rdynamic
EMU_TEST_AFTER_dlopen := $(EMU_SO)
EMU_TEST_BIN := $(patsubst %,$(BUILD)/tests/test_emu_%,$(EMU_TESTS))

define EMU_TEST_RULE
$(BUILD)/tests/test_emu_$(1): $(EMU_OBJ)/test_emu_$(1).o $(patsubst %,$(EMU_OBJ)/kernels/%.o,$(EMU_TEST_KERNELS_$(1))) $(EMU_TEST_EXTRA_OBJ_$(1)) \
		$(if $(filter ucontext,$(1)),$(EMU_RT_UC_OBJ),$(EMU_RT_OBJ)) $(EMU_HARNESS) | $(EMU_TEST_AFTER_$(1))
	@mkdir -p $$(dir $$@)
	$$(CXX) $(EMU_TEST_EXTRA_$(1)) -o $$@ $$^ $$(LDLIBS_ALL)
endef
$(foreach t,$(EMU_TESTS),$(eval $(call EMU_TEST_RULE,$(t))))

EMU_BENCH := $(BUILD)/tests/emu_bench
$(EMU_BENCH): $(EMU_OBJ)/emu_bench.o $(EMU_OBJ)/kernels/bench.o $(EMU_RT_OBJ)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $^ $(LDLIBS_ALL)

TEST_BIN += $(EMU_TEST_BIN)

emu-test:
	@$(MAKE) --no-print-directory BUILD=build SAN=0 $(patsubst %,build/tests/test_emu_%,$(EMU_TESTS)) \
		build/tests/emu_bench
	@sh $(EMU_DIR)/emu-test.sh build
