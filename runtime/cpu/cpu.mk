# The cpu backend (docs/cpu.md): runtime/cpu/*.c and the LLVM IR emitter compiler/emit_llvm*.c, built against
# LLVM 19's C API when llvm-config-19 is present (tools/ensure-deps.sh installs llvm-19-dev as root on Debian).
# Without it those files still compile, with KVQ_HAVE_LLVM undefined, and the backend's probe says it is
# unavailable and why. Included from the top-level Makefile.

# A usable llvm-config-19: with LLVM 19's development files beside it (tools/find-llvm.sh).
ifeq ($(origin LLVM_CONFIG),undefined)
LLVM_CONFIG := $(shell sh tools/find-llvm.sh)
endif
CPU_SRC := $(wildcard runtime/cpu/*.c compiler/emit_llvm*.c)
CPU_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(CPU_SRC))
$(LIB): $(CPU_OBJ)
$(CPU_OBJ): override CFLAGS += -Iruntime/ref
# The configuration the cpu objects were built with: when it changes (LLVM installed after a first build, or
# removed), they are rebuilt, not left as they were.
CPU_CONFIG := $(BUILD)/cpu-config
CPU_CONFIG_NOW := llvm-config=$(LLVM_CONFIG)
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),all)),)
$(shell mkdir -p $(BUILD); [ "$$(cat $(CPU_CONFIG) 2>/dev/null)" = "$(CPU_CONFIG_NOW)" ] || \
	echo "$(CPU_CONFIG_NOW)" >$(CPU_CONFIG))
# Under CI a cpu backend this machine could have built is a failure, not a skip (docs/testing.md).
ifeq ($(CI)$(LLVM_CONFIG),true)
$(error CI=true and LLVM 19's development files (llvm-config-19, llvm-c/Core.h, libLLVM-19.so) are not found: \
	the cpu backend would be built without LLVM 19 and its tests skipped. Install llvm-19-dev (tools/ensure-deps.sh \
	does, as root on Debian))
endif
endif
$(CPU_OBJ): $(CPU_CONFIG)
ifneq ($(LLVM_CONFIG),)
# Only the include path and the version macro: llvm-config's other cflags (-D__STDC_*) are C++ leftovers.
LLVM_INC := -isystem $(shell $(LLVM_CONFIG) --includedir)
$(CPU_OBJ): override CFLAGS += $(LLVM_INC) -DKVQ_HAVE_LLVM=1
# One shared library (libLLVM-19.so): the static component list would add ~100 MB to every test program.
LLVM_LDLIBS := $(shell $(LLVM_CONFIG) --ldflags) -Wl,-rpath,$(shell $(LLVM_CONFIG) --libdir) \
	$(shell $(LLVM_CONFIG) --link-shared --libs)
LDLIBS += $(LLVM_LDLIBS)
endif

# bench/cpu: a private timing program (docs/cpu.md); the official benchmark is `kvq bench`.
BENCH_CPU := $(BUILD)/bench/bench_cpu_decode
$(BENCH_CPU): bench/cpu/bench_cpu_decode.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIB) $(LDLIBS_ALL)
EXTRA_ALL += $(BENCH_CPU)
# bench/cpu/bench_cpu_tile.c: one tile kernel alone, through the emitter's internal API (docs/cpu.md "GQA > 1").
BENCH_CPU_TILE := $(BUILD)/bench/bench_cpu_tile
$(BENCH_CPU_TILE): bench/cpu/bench_cpu_tile.c $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(LIB) $(LDLIBS_ALL)
EXTRA_ALL += $(BENCH_CPU_TILE)
