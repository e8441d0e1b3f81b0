# kvq build. `make` builds the library and tools into build/; `make test` builds everything again under
# AddressSanitizer + UndefinedBehaviorSanitizer into build/san/ and runs every test, ending with
# "N passed, N failed". Sources are picked up by directory: a new .c file in base/, compiler/ or runtime/
# joins libkvq; a new tests/unit/test_*.c becomes a test program.

BUILD ?= build
SAN ?= 0
CC ?= cc
# -ffp-contract=off: the quantizer's arithmetic is specified rounding by rounding (runtime/quant.h).
# -MMD: header dependencies, so a changed header rebuilds what includes it.
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g -O2 -ffp-contract=off -Wall -Wextra -Werror -MMD -MP
INCLUDES := -Itests -Itools/common -Ibase -Icompiler -Iruntime -Iruntime/include -Igrammar -I$(BUILD)/gen
ifeq ($(SAN),1)
SANFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
endif
CFLAGS_ALL = $(CFLAGS_BASE) $(SANFLAGS) $(INCLUDES) $(CFLAGS)
LDLIBS_ALL = $(SANFLAGS) -lm -ldl -lpthread $(LDLIBS)

.DEFAULT_GOAL := all

# ---- tools the build needs (installed by the project itself on Debian when run as root) ----
DEPS_STAMP := $(BUILD)/.deps-ok
$(DEPS_STAMP):
	@sh tools/ensure-deps.sh
	@mkdir -p $(BUILD) && touch $@

# ---- grammar: parser and lexer generated at build time ----
GEN := $(BUILD)/gen
# Grouped targets (&:): one bison/flex run makes both files, also under make -j.
$(GEN)/kvq_parse.c $(GEN)/kvq_parse.h &: grammar/kvq.y | $(DEPS_STAMP)
	@mkdir -p $(GEN)
	bison -Wall -Werror -o $(GEN)/kvq_parse.c --header=$(GEN)/kvq_parse.h $<
$(GEN)/kvq_lex.c $(GEN)/kvq_lex.h &: grammar/kvq.l $(GEN)/kvq_parse.h | $(DEPS_STAMP)
	@mkdir -p $(GEN)
	flex -o $(GEN)/kvq_lex.c --header-file=$(GEN)/kvq_lex.h $<

GEN_SRC := $(GEN)/kvq_parse.c $(GEN)/kvq_lex.c
LIB_SRC := $(wildcard base/*.c compiler/*.c runtime/*.c runtime/backend/*.c runtime/ref/*.c)
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

# ---- tools ----
TOOLS := $(BUILD)/kvqc $(BUILD)/kvq
# Each tool is the .c files of its folder: tools/kvqc/ (compile side), tools/kvq/ (runtime side), plus
# tools/common/ (spec loading and diagnostics, option parsing).
TOOL_COMMON_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/common/*.c))
KVQC_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/kvqc/*.c)) $(TOOL_COMMON_OBJ)
KVQ_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/kvq/*.c)) $(TOOL_COMMON_OBJ)
$(BUILD)/kvqc: $(KVQC_OBJ) $(LIB)
	$(CC) -o $@ $^ $(LDLIBS_ALL)
$(BUILD)/kvq: $(KVQ_OBJ) $(LIB)
	$(CC) -o $@ $^ $(LDLIBS_ALL)

# ---- tests ----
TEST_SRC := $(wildcard tests/unit/test_*.c)
TEST_BIN := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(TEST_SRC))
$(BUILD)/tests/test_%: $(BUILD)/obj/tests/unit/test_%.o $(BUILD)/obj/tests/harness.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS_ALL)

# Module fragments add their own targets and append to TEST_BIN / EXTRA_ALL.
EXTRA_ALL :=
-include tests/emu/module.mk
-include compiler/cuda.mk
-include runtime/cpu/cpu.mk

.PHONY: all lib tools tests test demo clean emu-test
all: $(LIB) $(TOOLS) $(EXTRA_ALL)
lib: $(LIB)
tools: $(TOOLS)
tests: $(TEST_BIN)

test:
	@$(MAKE) --no-print-directory BUILD=build/san SAN=1 all tests
	@sh tests/run.sh build/san

demo: all
	@sh tools/demo.sh $(BUILD)

clean:
	rm -rf build

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
