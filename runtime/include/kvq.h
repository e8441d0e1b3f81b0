/* kvq: the one header a host program includes.
 *
 * Conventions (SQLite's): every call returns a kvq_status; on failure the handle involved keeps a message
 * (kvq_*_errmsg), there is no global "last error", the library never prints, aborts or exits, and nothing is
 * leaked on an error path. */
#ifndef KVQ_H
#define KVQ_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    KVQ_OK = 0,
    KVQ_ERR_SPEC = 1,        /* the spec has errors (see its diagnostics) */
    KVQ_ERR_INVALID = 2,     /* a bad argument: NULL, out of range, unknown name */
    KVQ_ERR_SHAPE = 3,       /* tensor shapes disagree with the engine or with each other */
    KVQ_ERR_NOMEM = 4,       /* an allocation failed; the state is as before the call */
    KVQ_ERR_IO = 5,          /* a file could not be opened, read or written */
    KVQ_ERR_FORMAT = 6,      /* a file's contents are malformed (.npy header, truncated data, corrupt cache) */
    KVQ_ERR_UNAVAILABLE = 7, /* the backend cannot run here (no driver, no GPU); the reason is in the message */
    KVQ_ERR_UNSUPPORTED = 8, /* valid, but this backend or build does not implement it */
    KVQ_ERR_STATE = 9,       /* the call is not valid in the object's current state (decode before prefill) */
    KVQ_ERR_INTERNAL = 10    /* a bug in kvq: please report it */
} kvq_status;

/* A short name for a status ("out of memory", ...). Never NULL. */
const char *kvq_status_str(kvq_status s);

/* The library's version: the one place it is written (the Makefile reads it for the shared library's soname and
 * kvq.pc). kvq_version() is the version of the library actually loaded, KVQ_VERSION the header's. */
#define KVQ_VERSION "0.1.0"
#define KVQ_VERSION_MAJOR 0
const char *kvq_version(void);

/* The folder the emu and cuda backends read their run-time sources from (templates/, tests/emu/, generated/):
 * $KVQ_SRCDIR when set; else <dir of the loaded libkvq>/../share/kvq when an installed copy is there; else the
 * checkout the library was built in. Never NULL. */
const char *kvq_data_dir(void);

/* ------------------------------------------------------------------------------------------------------------
 * Specs: parse and check a .kvq file. A spec holds one or more resolved schemes and the diagnostics of the
 * parse. kvq_spec_parse_* set *out even when the spec has errors (so the caller can read the diagnostics); the
 * caller frees it with kvq_spec_free. They return KVQ_ERR_SPEC when there is at least one error, KVQ_ERR_NOMEM
 * or KVQ_ERR_IO (with a diagnostic naming the file) when the spec could not be read, *out may then be NULL only
 * for KVQ_ERR_NOMEM. */
typedef struct kvq_spec kvq_spec;
typedef struct kvq_scheme kvq_scheme; /* resolved, read-only; owned by its spec */

typedef enum { KVQ_DIAG_ERROR = 0, KVQ_DIAG_WARNING = 1, KVQ_DIAG_NOTE = 2 } kvq_diag_severity;

typedef struct {
    const char *file;  /* the file the diagnostic is in (an included file's own path) */
    int line, col;     /* 1-based; col counts bytes */
    kvq_diag_severity severity;
    const char *message;
    /* The source line around the column (printable, cut to a window on very long lines) and the caret's column
     * within it, for tools that show where the diagnostic points; NULL / 0 when there is no source line. */
    const char *snippet;
    int snippet_col;
} kvq_diag;

kvq_status kvq_spec_parse_file(const char *path, kvq_spec **out);
/* `name` is what diagnostics call the text; includes resolve relative to the current directory.
 * The language is documented in docs/language.md. A spec with errors still lists the schemes it could resolve
 * (for tools that show them), but only a spec that parses with KVQ_OK is meant to be run. */
kvq_status kvq_spec_parse_string(const char *name, const char *text, size_t len, kvq_spec **out);
void kvq_spec_free(kvq_spec *spec);

int kvq_spec_diag_count(const kvq_spec *spec);
const kvq_diag *kvq_spec_diag(const kvq_spec *spec, int i);
int kvq_spec_error_count(const kvq_spec *spec);
/* Formats diagnostic i as "file:line:col: error: message" into buf (always NUL-terminated); returns its length. */
size_t kvq_diag_format(const kvq_diag *d, char *buf, size_t size);

int kvq_spec_scheme_count(const kvq_spec *spec);
const kvq_scheme *kvq_spec_scheme_at(const kvq_spec *spec, int i);
/* By name; NULL name: the spec's only scheme (NULL if it has several). NULL if not found. */
const kvq_scheme *kvq_spec_scheme(const kvq_spec *spec, const char *name);
const char *kvq_scheme_name(const kvq_scheme *scheme);

/* ------------------------------------------------------------------------------------------------------------
 * Memory accounting (the same figures the runtime allocates): the cache after a prefill of `seq` tokens. */
typedef struct {
    int layers, heads, kv_heads, head_dim;
} kvq_dims;

typedef enum {
    KVQ_SEG_SINK = 0,     /* first tokens, fp16 */
    KVQ_SEG_BODY_HIGH,    /* quantized body: codes of the only precision class, or the salient (high-bit) class */
    KVQ_SEG_BODY_LOW,     /* quantized body: codes of the low-bit class (saliency policies) */
    KVQ_SEG_PARAMS,       /* scales, zeros and channel factors of the quantized body */
    KVQ_SEG_OUTLIER,      /* outlier pool, fp16 */
    KVQ_SEG_SPILL,        /* spill pool, fp16 */
    KVQ_SEG_RESIDUAL,     /* residual window and tokens waiting for compression, fp16 */
    KVQ_SEG_SPARSE_LOCAL, /* sparse layers: tokens kept on the device (sinks + recent + generated), fp16 */
    KVQ_SEG_HOST,         /* sparse layers: the full fp16 K/V offloaded to host memory */
    KVQ_SEG_COUNT
} kvq_segment;

const char *kvq_segment_name(kvq_segment seg);

typedef struct {
    uint64_t bytes[KVQ_SEG_COUNT];   /* bytes of K and V together, over all layers, sequences and kv heads */
    uint64_t tokens[KVQ_SEG_COUNT];  /* token slots (one token of one kv head of one layer of one sequence) */
    uint64_t device_bytes;           /* everything but KVQ_SEG_HOST */
    uint64_t fp16_bytes;             /* the same cache kept entirely in fp16 */
    double effective_bits;           /* device bits per stored K/V element, metadata included */
    double compression_ratio;        /* fp16_bytes / device_bytes */
} kvq_mem_stats;

typedef struct {
    /* ZipCache Appendix A assumes channel parameters (per-channel key scale/zero, channel-separable factors)
     * are shared by the whole batch; kvq keeps them per sequence unless this is set. Accounting only. */
    int share_channel_params_across_batch;
    /* Sparse (TailorKV) layers decided by calibration: which layers are sparse when the scheme's mode is AUTO.
     * NULL: AUTO layers are counted as quantized. Indexed by layer, nonzero = sparse. */
    const unsigned char *auto_sparse;
} kvq_account_opts;

/* Bytes by segment in closed form (O(layers), whatever the length). KVQ_ERR_INVALID for a NULL argument, batch < 1,
 * seq < 0, or a byte count that would pass 2^63 - 1; the errors of kvq_scheme_check_dims for dims the scheme
 * cannot run at. */
kvq_status kvq_scheme_account(const kvq_scheme *scheme, const kvq_dims *dims, int batch, int seq,
                              const kvq_account_opts *opts, kvq_mem_stats *out);

/* Whether `scheme` can run at `dims`: the one check kvq_engine_create, kvq_scheme_account, `kvqc report` and
 * `kvq eval` share. Layers, heads and kv_heads in 1..4096 (the language's caps), heads a multiple of kv_heads,
 * head_dim 64, 96, 128 or 256, no contradiction with the scheme's model block, every per-token group dividing
 * head_dim, critical_channels <= head_dim, sparse/auto layers only with a classify block. KVQ_ERR_SHAPE or
 * KVQ_ERR_INVALID with the reason in msg (may be NULL). */
kvq_status kvq_scheme_check_dims(const kvq_scheme *scheme, const kvq_dims *dims, char *msg, size_t msg_size);

/* ==== RUNTIME API (engine, sequences, prefill/decode, statistics, calibration): below this line ==== */

typedef struct kvq_engine kvq_engine;
typedef struct kvq_seq kvq_seq;

typedef enum {
    KVQ_BACKEND_REFERENCE = 0, /* plain C, the oracle */
    KVQ_BACKEND_CUDA = 1,      /* NVRTC-compiled kernels on a GPU (unavailable without a driver and a GPU) */
    KVQ_BACKEND_EMU = 2,       /* the same generated CUDA kernels run on the CPU by the SIMT emulator */
    KVQ_BACKEND_CPU = 3        /* LLVM-compiled kernels on the host CPU, threaded (unavailable without LLVM) */
} kvq_backend_kind;

const char *kvq_backend_name(kvq_backend_kind kind);

/* Element type of the K/V/Q tensors a host passes in. */
typedef enum { KVQ_F32 = 0, KVQ_F16 = 1, KVQ_BF16 = 2 } kvq_dtype;

typedef struct {
    kvq_dims dims;           /* heads a multiple of kv_heads (MHA, GQA, MQA); head_dim 64, 96, 128 or 256 */
    kvq_backend_kind backend;
    kvq_dtype dtype;         /* of every tensor passed to prefill/decode/calibrate */
    uint64_t seed;           /* random choices (ZipCache random probes) */
    float softmax_scale;     /* 0: 1/sqrt(head_dim) */
    int threads;             /* cpu backend: worker threads; 0 = the machine's online cores */
} kvq_engine_config;

void kvq_engine_config_init(kvq_engine_config *cfg); /* defaults: reference backend, fp16, seed 0 */

/* Creates an engine running `scheme` (which must outlive the engine) for the given dims. On failure *out is
 * NULL and errbuf (if given) holds the reason. */
kvq_status kvq_engine_create(const kvq_scheme *scheme, const kvq_engine_config *cfg, kvq_engine **out,
                             char *errbuf, size_t errbuf_size);
void kvq_engine_free(kvq_engine *engine); /* frees its sequences too */
/* The message of the engine's last failed call ("" if none). Valid until the next call on the engine. */
const char *kvq_engine_errmsg(const kvq_engine *engine);

kvq_status kvq_seq_create(kvq_engine *engine, kvq_seq **out);
void kvq_seq_free(kvq_engine *engine, kvq_seq *seq);
/* Tokens the sequence holds in `layer` (prefilled + decoded). */
int kvq_seq_length(const kvq_seq *seq, int layer);

/* Prefill of one layer for a batch of sequences (each its own length). Layouts, C order, engine dtype:
 *   k, v: [kv_heads][n_tokens][head_dim]     q: [heads][n_tokens][head_dim]
 * q is the prompt's queries: needed by schemes with saliency (probes) or calibration; NULL otherwise. A
 * sequence is prefilled once per layer, before any decode of that layer. */
typedef struct {
    kvq_seq *seq;
    int n_tokens;
    const void *k, *v, *q;
} kvq_prefill_item;
kvq_status kvq_prefill(kvq_engine *engine, int layer, const kvq_prefill_item *items, int n_items);
/* Whether kvq_prefill of `layer` needs the prompt's queries now: 1 (a saliency policy's probes, or the layer's
 * calibration is still to come), 0 (q may be NULL: a host can skip gathering them), -1 (NULL engine or a layer
 * out of range). */
int kvq_prefill_needs_queries(const kvq_engine *engine, int layer);

/* One decode step of one layer for a batch: append each sequence's new token, then attend with its query over
 * the whole cache (the new token included). k, v: [kv_heads][head_dim]; q: [heads][head_dim];
 * out: [heads][head_dim] fp32. */
typedef struct {
    kvq_seq *seq;
    const void *k, *v, *q;
    float *out;
} kvq_decode_item;
kvq_status kvq_decode(kvq_engine *engine, int layer, const kvq_decode_item *items, int n_items);

/* Memory of the cache as allocated now, over every live sequence (or one). A failure (NULL out or seq, a sequence
 * of another engine) is KVQ_ERR_INVALID with its message on the engine, as for every other call: the handle is
 * const because statistics change no state; the message is the one field they write. */
kvq_status kvq_engine_stats(const kvq_engine *engine, kvq_mem_stats *out);
kvq_status kvq_seq_stats(const kvq_engine *engine, const kvq_seq *seq, kvq_mem_stats *out);

/* The cache of one (sequence, layer) as attention sees it, in token order: quantized tokens dequantized,
 * fp16 tokens as stored, a pooled outlier as its fp16 copy. k, v: [kv_heads][capacity][head_dim] fp32;
 * *n_tokens receives the length (KVQ_ERR_INVALID if capacity is too small). */
kvq_status kvq_seq_read_cache(kvq_engine *engine, const kvq_seq *seq, int layer, float *k, float *v,
                              int capacity, int *n_tokens);

/* TailorKV offline identification (Eq. 6-9) for one layer whose scheme mode is auto: the dense preference score
 * from the last n_q queries of a calibration prompt, which decides the layer's mode. k: [kv_heads][n][D],
 * q: [heads][n][D]. A layer left undecided is calibrated from its first prefill. */
kvq_status kvq_calibrate_layer(kvq_engine *engine, int layer, int n_tokens, const void *k, const void *q,
                               double *score_out);
typedef enum { KVQ_LAYER_QUANTIZED = 0, KVQ_LAYER_SPARSE = 1, KVQ_LAYER_UNDECIDED = 2 } kvq_layer_state;
kvq_layer_state kvq_engine_layer_state(const kvq_engine *engine, int layer);

/* ---- Device tensors (GPU backends: cuda, emu; docs/cuda.md "Device tensors") ----
 * For an inference engine whose tensors live on the GPU: q, k, v and the outputs stay in device memory, the
 * work goes on the caller's CUDA stream, and a decode step makes no synchronisation, no allocation (after
 * warm-up, or with kvq_engine_reserve_device) and no device-to-host copy (a ZipCache compression included: its
 * classes stay on the device), so it can be captured in a CUDA graph. The engine uses the CUDA context current on the thread that created it
 * (else the device's primary context); pointers must belong to it. Under the emu backend "device memory" is the
 * emulator's (host memory). Inputs are not checked for non-finite values (the host API's input policy would need
 * them on the host). Any thread may call these, one at a time per engine. */
typedef struct {
    void *data;              /* device address of element [0][0][0] */
    kvq_dtype dtype;         /* inputs KVQ_F16 or KVQ_BF16; outputs also KVQ_F32 */
    long long token_stride;  /* elements from one token's row to the next (>= 0) */
    long long head_stride;   /* elements from one head to the next (>= 0); a head's head_dim elements are contiguous */
} kvq_dev_tensor;

/* Append-and-attend of one layer for a batch, as kvq_decode: row i of q ([n][heads][D]), k and v ([n][kv_heads][D])
 * is seqs[i]'s new token; out ([n][heads][D]) receives attention over its whole cache; lse (NULL, or device float
 * [n][heads], contiguous) its natural log-sum-exp of the scaled scores. stream: a CUstream, NULL for the
 * engine's own. Returns when the work is queued: read out after the stream has run it. */
typedef struct {
    kvq_seq *const *seqs;
    int n_seqs;
    kvq_dev_tensor q, k, v, out;
    float *lse;
    void *stream;
} kvq_dev_decode;
kvq_status kvq_decode_device(kvq_engine *engine, int layer, const kvq_dev_decode *batch);

/* Batched varlen prefill of one layer, as kvq_prefill: sequence i's prompt is rows [cu_seqlens[i],
 * cu_seqlens[i + 1]) of k, v ([total][kv_heads][D]) and q ([total][heads][D]; data NULL when the layer needs no
 * queries). cu_seqlens is a host array of n_seqs + 1 ascending offsets from 0 (the plan is made on the host).
 * The tensors' dtype must be the engine's (kvq_engine_config.dtype), or the engine fp32. The rows are read once
 * into host memory (a prefill is not a step: this synchronises with stream) and take kvq_prefill's path. */
typedef struct {
    kvq_seq *const *seqs;
    int n_seqs;
    const int *cu_seqlens;
    kvq_dev_tensor q, k, v;
    void *stream;
} kvq_dev_prefill;
kvq_status kvq_prefill_device(kvq_engine *engine, int layer, const kvq_dev_prefill *batch);

/* GPU backends (cuda, emu): takes `bytes` of device memory for the engine's page pool now, so that prefills and
 * decode steps whose cache fits in it allocate no device memory (a decode step can then be captured in a CUDA
 * graph; docs/cuda.md "The host protocol"). Without a reservation the pool grows by slabs of at least 16 MiB,
 * doubling, when it runs out. Other backends: does nothing. KVQ_ERR_NOMEM when the device has not that much. */
kvq_status kvq_engine_reserve_device(kvq_engine *engine, size_t bytes);
/* ---- Planned decode steps: a step that replays as a CUDA graph (GPU backends; docs/cuda.md "Planned steps") ----
 * FlashInfer's model: kvq_decode_plan makes the host half of the next decode step of EVERY layer for a batch
 * (each layer's bookkeeping advances by one token: window slots, flush decisions, pages from the engine's pool,
 * tiles and split-KV) and sends it with one async copy from page-locked memory into step tables at fixed device
 * addresses; kvq_decode_run(layer) then queues that layer's device work, whose kernels, grids and parameter bytes
 * are the same at every step for a given batch size and tensors. So a host program captures the runs of every
 * layer once into a CUDA graph and, at each later step, writes the step's q/k/v into the same buffers, calls
 * kvq_decode_plan and launches the graph. Outputs, caches and statistics equal kvq_decode_device's bit for bit.
 * Covers quantized layers (KIVI, fp16, per-token / per-channel specs, windows, sinks), OTT's outlier pools (the
 * competition of a flush is a fixed launch, decided on the device), TailorKV's sparse layers (the retrieval of
 * every step likewise) and ZipCache's layers with a window (probe rows and compressions likewise); ZipCache
 * without a window is refused (KVQ_ERR_UNSUPPORTED): capture those steps one at a time with kvq_decode_device. */

/* Allocates the step tables and buffers once, for batches of up to max_batch sequences of up to max_tokens tokens
 * (after the step): their addresses never change. A later call replaces them (capture again). It also sizes the
 * scratch and page-locked staging of kvq_decode_device's steps for max_batch, so that after it no step allocates
 * or frees device memory (a first step may be captured). */
kvq_status kvq_engine_reserve_step(kvq_engine *engine, int max_batch, int max_tokens);
/* The host half of the next step of every layer for seqs[0 .. n_seqs) (each prefilled in every layer), its one
 * copy queued on stream (NULL: the engine's own). All-or-nothing: on failure every layer of every sequence is as
 * it was. KVQ_ERR_STATE without a reservation, KVQ_ERR_SHAPE beyond it. Lengths (kvq_seq_length) count the
 * planned token at once; its device work is done by the runs, which must follow before the next plan (read_cache
 * after they ran). The copy reads one of two page-locked buffers, used in turn: before writing one again the plan
 * waits for the event recorded after the copy that read it two plans ago (at once in a loop that read that step's
 * outputs). */
kvq_status kvq_decode_plan(kvq_engine *engine, kvq_seq *const *seqs, int n_seqs, void *stream);
/* The device half of layer `layer` of the planned step: batch->seqs must be the planned sequences in the planned
 * order; q, k, v, out, lse and stream as kvq_decode_device. Queues the work and returns; changes no host state
 * (except that a failed run marks the layer's device tile lists to be sent whole by the next plan), so what it
 * queues may be captured once and replayed at every later step of the same batch. */
kvq_status kvq_decode_run(kvq_engine *engine, int layer, const kvq_dev_decode *batch);

/* Writes the decided per-layer map as a .kvq scheme `name` inheriting the engine's scheme (which must come from
 * a file: the output includes it). KVQ_ERR_STATE when the scheme has no classify block (no map to write) or a
 * layer is undecided. */
kvq_status kvq_engine_write_layer_map(kvq_engine *engine, const char *path, const char *name);


#ifdef __cplusplus
}
#endif
#endif
