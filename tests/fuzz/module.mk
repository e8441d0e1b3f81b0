# Fuzz targets (tests/fuzz/fuzz_*.c, docs/testing.md). Two ways to run them:
#   - `make test`: each target linked with tests/fuzz/replay.c (a plain-C driver, built by $(CC) like every test)
#     as $(BUILD)/tests/test_fuzz_<target>: replays tests/fuzz/corpus/<target>/ and mutates it for a few seconds;
#   - `make fuzz FUZZ_TIME=60`: libFuzzer (clang -fsanitize=fuzzer,address,undefined) for FUZZ_TIME seconds per
#     target, with the seed corpus and tests/fuzz/<target>.dict; new inputs go to build/fuzz/corpus/<target>/,
#     crashes to build/fuzz/crash-<target>-*. clang is installed by tools/ensure-deps.sh --fuzz when missing.
FUZZ_TARGETS := spec npy engine
FUZZ_TIME ?= 60
FUZZ_CC ?= clang
FUZZ_CXX ?= clang++
FUZZ_JOBS ?= 1
# Per-target options: the engine's inputs are a header of ~30 bytes then value patches, and it runs slowly
# (every backend per input), so libFuzzer's slow growth of the length limit would keep the patches out.
FUZZ_OPTS_engine := -len_control=0 -max_len=512
# libFuzzer's -jobs writes each job's output to fuzz-N.log in the current directory: only when asked for.
FUZZ_PARALLEL := $(if $(filter-out 1,$(FUZZ_JOBS)),-fork=$(FUZZ_JOBS),)

$(BUILD)/tests/test_fuzz_%: $(BUILD)/obj/tests/fuzz/fuzz_%.o $(BUILD)/obj/tests/fuzz/replay.o $(BUILD)/obj/tests/harness.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) -o $@ $^ $(LDLIBS_ALL)
TEST_BIN += $(patsubst %,$(BUILD)/tests/test_fuzz_%,$(FUZZ_TARGETS))

# libFuzzer builds: libkvq again with clang, coverage instrumentation and the sanitizers, in build/fuzz/lib.
FUZZ_DIR := build/fuzz
FUZZ_FLAGS := -fsanitize=fuzzer-no-link
.PHONY: fuzz fuzz-build
fuzz-build:
	@sh tools/ensure-deps.sh --fuzz
	@$(MAKE) --no-print-directory BUILD=$(FUZZ_DIR)/lib CC=$(FUZZ_CC) SAN=1 CFLAGS="$(FUZZ_FLAGS)" $(FUZZ_DIR)/lib/libkvq.a
	@for t in $(FUZZ_TARGETS); do \
		$(FUZZ_CC) $(CFLAGS_BASE) -I$(FUZZ_DIR)/lib/gen $(filter-out -I$(BUILD)/gen,$(INCLUDES)) \
			-fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer \
			-o $(FUZZ_DIR)/fuzz_$$t tests/fuzz/fuzz_$$t.c $(FUZZ_DIR)/lib/libkvq.a -lm -ldl -lpthread $(LLVM_LDLIBS) || exit 1; \
	done
fuzz: fuzz-build
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p $(FUZZ_DIR)/corpus/$$t; opts=""; [ $$t = engine ] && opts="$(FUZZ_OPTS_engine)"; \
		echo "== fuzz_$$t for $(FUZZ_TIME) s"; \
		KVQ_SRCDIR=$(CURDIR) KVQ_CACHE_DIR=$(CURDIR)/$(FUZZ_DIR)/cache KVQ_EMU_CC=$(FUZZ_CC) KVQ_EMU_CXX=$(FUZZ_CXX) \
		ASAN_OPTIONS=$${ASAN_OPTIONS:-intercept_tls_get_addr=0} \
		$(FUZZ_DIR)/fuzz_$$t -max_total_time=$(FUZZ_TIME) $(FUZZ_PARALLEL) \
			-print_final_stats=1 -max_len=4096 $$opts -dict=tests/fuzz/$$t.dict -artifact_prefix=$(FUZZ_DIR)/crash-$$t- \
			$(FUZZ_DIR)/corpus/$$t tests/fuzz/corpus/$$t 2>&1 | tee $(FUZZ_DIR)/fuzz_$$t.log | \
			grep -E '^#[0-9]+ +(DONE|INITED)|^stat::|ERROR|SUMMARY|invariant' ; \
		test -z "$$(ls $(FUZZ_DIR)/crash-$$t-* 2>/dev/null)" || { echo "fuzz_$$t: crash saved in $(FUZZ_DIR)"; exit 1; }; \
	done
