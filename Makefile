# kvq build. `make` builds the library and tools into build/; `make test` builds everything again under
# AddressSanitizer + UndefinedBehaviorSanitizer into build/san/ and runs every test, ending with
# "N passed, N failed". Sources are picked up by directory: a new .c file in base/, layout/, compiler/ or runtime/
# joins libkvq; a new tests/unit/test_*.c becomes a test program.

BUILD ?= build
SAN ?= 0
CC ?= cc
# -ffp-contract=off: the quantizer's arithmetic is specified rounding by rounding (runtime/quant.h).
# -MMD: header dependencies, so a changed header rebuilds what includes it.
# -fPIC: the same objects make libkvq.a and libkvq.so.
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g -O2 -ffp-contract=off -Wall -Wextra -Werror -MMD -MP -fPIC
INCLUDES := -Itests -Itools/common -Ibase -Ilayout -Icompiler -Iruntime -Iruntime/include -Igrammar -I$(BUILD)/gen
ifeq ($(SAN),1)
SANFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
endif
CFLAGS_ALL = $(CFLAGS_BASE) $(SANFLAGS) $(INCLUDES) $(CFLAGS)
LDLIBS_ALL = $(SANFLAGS) -lm -ldl -lpthread $(LDLIBS)

.DEFAULT_GOAL := all

# ---- tools the build needs (installed by the project itself on Debian when run as root) ----
# tools/ensure-deps.sh runs while make reads this file, before runtime/cpu/cpu.mk asks for llvm-config-19: on a
# fresh machine the first `make` installs LLVM 19, flex and bison and then builds the cpu backend with them.
# Once per make invocation tree (KVQ_DEPS_CHECKED is exported to the sub-makes); `make clean` skips it.
ifeq ($(KVQ_DEPS_CHECKED)$(filter-out clean,$(or $(MAKECMDGOALS),all)),)
else ifeq ($(KVQ_DEPS_CHECKED),)
DEPS_OUT := $(shell sh tools/ensure-deps.sh >&2; echo $$?)
ifneq ($(DEPS_OUT),0)
$(error the build tools above are missing (tools/ensure-deps.sh))
endif
export KVQ_DEPS_CHECKED := 1
endif

# ---- grammar: parser and lexer generated at build time ----
GEN := $(BUILD)/gen
# Grouped targets (&:): one bison/flex run makes both files, also under make -j.
$(GEN)/kvq_parse.c $(GEN)/kvq_parse.h &: grammar/kvq.y
	@mkdir -p $(GEN)
	bison -Wall -Werror -o $(GEN)/kvq_parse.c --header=$(GEN)/kvq_parse.h $<
$(GEN)/kvq_lex.c $(GEN)/kvq_lex.h &: grammar/kvq.l $(GEN)/kvq_parse.h
	@mkdir -p $(GEN)
	flex -o $(GEN)/kvq_lex.c --header-file=$(GEN)/kvq_lex.h $<

GEN_SRC := $(GEN)/kvq_parse.c $(GEN)/kvq_lex.c
LIB_SRC := $(wildcard base/*.c layout/*.c compiler/*.c runtime/*.c runtime/backend/*.c runtime/ref/*.c)
LIB_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_SRC)) $(patsubst $(GEN)/%.c,$(BUILD)/obj/gen/%.o,$(GEN_SRC))
LIB := $(BUILD)/libkvq.a

# Generated code is warning-clean under -Wall -Wextra except for flex's unused helpers.
$(BUILD)/obj/gen/%.o: $(GEN)/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -Wno-unused-function -Wno-sign-compare -c $< -o $@
$(BUILD)/obj/%.o: %.c | $(GEN)/kvq_parse.h $(GEN)/kvq_lex.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -c $< -o $@

$(LIB): $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

# ---- shared library: libkvq.so -> libkvq.so.MAJOR -> libkvq.so.VERSION (the version is kvq.h's KVQ_VERSION) ----
VERSION := $(shell sed -n 's/^\#define KVQ_VERSION "\(.*\)"/\1/p' runtime/include/kvq.h)
SONAME := libkvq.so.$(firstword $(subst ., ,$(VERSION)))
SOLIB := $(BUILD)/libkvq.so.$(VERSION)
# Only the kvq_ names are exported (tools/libkvq.map). -Bsymbolic: the library's calls to its own kvq_ functions
# bind inside it, so no other object in the process (the emulator's dlopened kernels define kvq_ names of
# their own) can interpose them; without it the emu backend crashed from an installed libkvq.so.
$(SOLIB): $(LIB) tools/libkvq.map
	$(CC) -shared -Wl,-soname,$(SONAME) -Wl,-Bsymbolic -Wl,--version-script=tools/libkvq.map -Wl,--no-undefined -o $@ \
		-Wl,--whole-archive $(LIB) -Wl,--no-whole-archive $(LDLIBS_ALL)
	ln -sf libkvq.so.$(VERSION) $(BUILD)/$(SONAME)
	ln -sf $(SONAME) $(BUILD)/libkvq.so

# ---- tools ----
TOOLS := $(BUILD)/kvqc $(BUILD)/kvq
# Each tool is the .c files of its folder: tools/kvqc/ (compile side), tools/kvq/ (runtime side), plus
# tools/common/ (spec loading and diagnostics, option parsing).
TOOL_COMMON_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/common/*.c))
KVQC_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/kvqc/*.c)) $(TOOL_COMMON_OBJ)
KVQ_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/kvq/*.c)) $(TOOL_COMMON_OBJ)
# The tools print kvq.h's version (--version).
$(BUILD)/kvqc: $(KVQC_OBJ) $(LIB)
	$(CC) -o $@ $^ $(LDLIBS_ALL)
$(BUILD)/kvq: $(KVQ_OBJ) $(LIB)
	$(CC) -o $@ $^ $(LDLIBS_ALL)

# ---- tests ----
TEST_SRC := $(wildcard tests/unit/test_*.c)
TEST_BIN := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(TEST_SRC))
$(BUILD)/tests/test_%: $(BUILD)/obj/tests/unit/test_%.o $(BUILD)/obj/tests/harness.o $(BUILD)/obj/tests/tool_run.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS_ALL)

# tests/run.sh's NVRTC helper (tests/nvrtc_helper.c): `make test` builds it in the plain build, without the
# sanitizers, and the sanitized programs have it compile their CUDA units (runtime/cuda/cu_nvrtc.c).
$(BUILD)/tests/nvrtc-helper: $(BUILD)/obj/tests/nvrtc_helper.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS_ALL)
# ...and its LLVM helper (tests/llvm_helper.c): the cpu backend's default<O3> and code generation of a module
# (compiler/emit_llvm_jit.c).
$(BUILD)/tests/llvm-helper: $(BUILD)/obj/tests/llvm_helper.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS_ALL)

# Module fragments add their own targets and append to TEST_BIN / EXTRA_ALL.
EXTRA_ALL :=
-include tests/emu/module.mk
-include tests/fakecuda/module.mk
-include compiler/cuda.mk
-include tests/fuzz/module.mk
-include runtime/cpu/cpu.mk
-include tools/gpu-bundle.mk

.PHONY: all lib tools tests test demo bench-cpu clean emu-test install
all: $(LIB) $(SOLIB) $(TOOLS) $(EXTRA_ALL)
lib: $(LIB) $(SOLIB)
tools: $(TOOLS)
tests: $(TEST_BIN)

# The install and Python tests (tests/sh/) load libkvq.so into programs built without sanitizers: they use the
# plain build in build/.
# The Python tests' virtualenv (torch: minutes of download) is made in the background while the C code compiles.
# The two builds use every core (TEST_BUILD_JOBS, default nproc) even when make was run without -j: the README's
# `make test` is what CI and a new user run, and a serial build of both was minutes of one core.
TEST_BUILD_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test:
	@mkdir -p build; sh tools/python-venv.sh build >build/venv.out 2>&1 & venv=$$!; \
	$(MAKE) --no-print-directory -j$(TEST_BUILD_JOBS) BUILD=build/san SAN=1 all tests && \
	sh tools/ensure-sass-tools.sh build && \
	$(MAKE) --no-print-directory -j$(TEST_BUILD_JOBS) BUILD=build SAN=0 all build/tests/nvrtc-helper build/tests/llvm-helper; st=$$?; \
	wait $$venv; cat build/venv.out; [ $$st -eq 0 ] && sh tests/run.sh build/san build

# ---- install: make install PREFIX=/usr/local [DESTDIR=...] (docs/install.md) ----
PREFIX ?= /usr/local
DEST := $(DESTDIR)$(PREFIX)
# What the emu and cuda backends read at run time (kvq_data_dir in kvq.h), in the checkout's shape.
EMU_RUNTIME_FILES := exec.c warp.c cp_async.c fiber.c profile.c emu.h emu_abi.h emu_internal.h fiber.h emu_cuda.h emu_half.h
install: $(LIB) $(SOLIB) $(TOOLS)
	mkdir -p $(DEST)/include $(DEST)/lib/pkgconfig $(DEST)/bin $(DEST)/share/kvq/templates $(DEST)/share/kvq/tests/emu
	cp runtime/include/kvq.h $(DEST)/include/
	cp $(LIB) $(SOLIB) $(DEST)/lib/
	ln -sf libkvq.so.$(VERSION) $(DEST)/lib/$(SONAME)
	ln -sf $(SONAME) $(DEST)/lib/libkvq.so
	cp $(TOOLS) $(DEST)/bin/
	cp templates/*.cuh $(DEST)/share/kvq/templates/
	cp $(addprefix tests/emu/,$(EMU_RUNTIME_FILES)) $(DEST)/share/kvq/tests/emu/
	cp -R generated $(DEST)/share/kvq/
	cp -R specs $(DEST)/share/kvq/
	mkdir -p $(DEST)/share/kvq/python/kvq && cp python/kvq/plot.py $(DEST)/share/kvq/python/kvq/
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@VERSION@|$(VERSION)|' -e 's|@LLVM_LIBS@|$(LLVM_LDLIBS)|' tools/kvq.pc.in > $(DEST)/lib/pkgconfig/kvq.pc

demo: all
	@sh tools/demo.sh $(BUILD)

# docs/bench.md's CPU tables (several minutes): markdown on stdout.
bench-cpu: all
	@sh bench/cpu.sh $(BUILD)

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
