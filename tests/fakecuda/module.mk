# The recording fake CUDA driver (tests/fakecuda, docs/testing.md "The fake CUDA driver"): a libcuda.so.1 that
# runs no kernels, logs every call and records breaches of the driver API's rules. Built with everything (make
# all), so that a tool can be pointed at it too (KVQ_LIBCUDA=$(BUILD)/tests/fakecuda/libcuda.so.1, e.g. to fill
# the NVRTC cache for an sm without a GPU: FAKECUDA_ARCH=sm_80). test_cuda_fakedrv loads it from beside itself.
FAKECUDA_SO := $(BUILD)/tests/fakecuda/libcuda.so.1
$(FAKECUDA_SO): tests/fakecuda/fakecuda.c tests/fakecuda/fakecuda.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -fvisibility=hidden -shared -Wl,-soname,libfakecuda.so.1 -MF $@.d -o $@ $< -lpthread $(SANFLAGS)
-include $(FAKECUDA_SO).d
$(BUILD)/tests/test_cuda_fakedrv: | $(FAKECUDA_SO)
EXTRA_ALL += $(FAKECUDA_SO)
