/* .npy read and write. The format (NumPy's NEP 1 and numpy/lib/format.py):
 *
 *   "\x93NUMPY" major minor  header_len (uint16 LE for 1.0, uint32 LE for 2.0 and 3.0)  header  data
 *
 * where header is a Python dict literal {'descr': ..., 'fortran_order': ..., 'shape': (...), } padded with
 * spaces and ended by '\n' (3.0 only differs in allowing UTF-8 in it, which matters for structured dtypes'
 * field names, which kvq does not read). The parser below accepts exactly the literals NumPy's reader accepts for
 * the dtypes kvq supports, and names the problem otherwise. */
#include "npy.h"

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "alloc.h"
#include "half.h"

#define MAGIC "\x93NUMPY"
#define MAGIC_LEN 6
/* A legitimate header for the dtypes kvq reads is a few hundred bytes; refusing more than this keeps a corrupt
 * length field from turning into a huge allocation when the file size cannot be known (a pipe). */
#define MAX_HEADER_LEN (1u << 20)
/* Data moves through a buffer of this many bytes: a multiple of every item size. */
#define CHUNK_BYTES 16384
/* A stream's data buffer starts at this many values and doubles as data arrives (a multiple of the chunk). */
#define STREAM_FIRST_VALUES ((size_t)1 << 18)

static void set_err(char *err, size_t errsz, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void set_err(char *err, size_t errsz, const char *path, const char *fmt, ...)
{
    if (!err || errsz == 0) return;
    int n = snprintf(err, errsz, "%s: ", path ? path : "(null)");
    if (n < 0 || (size_t)n >= errsz) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err + n, errsz - (size_t)n, fmt, ap);
    va_end(ap);
}

const char *kvq_npy_dtype_name(kvq_dtype dtype)
{
    switch (dtype) {
    case KVQ_F32: return "float32";
    case KVQ_F16: return "float16";
    case KVQ_BF16: return "bfloat16";
    }
    return NULL;
}

static size_t item_size(kvq_dtype dtype) { return dtype == KVQ_F32 ? 4 : 2; }

void kvq_npy_free(kvq_npy *a)
{
    if (!a) return;
    kvq_free(a->data);
    memset(a, 0, sizeof *a);
}

/* ---- header dict parser ---------------------------------------------------------------------------------- */

typedef struct {
    const char *p, *end, *start;
    const char *path;
    char *err;
    size_t errsz;
} hparse;

typedef struct {
    int have_descr, have_fortran, have_shape;
    char descr[64];
    int descr_truncated;
    int fortran;
    int ndim;
    size_t shape[KVQ_NPY_MAX_DIMS];
} hdr;

static void skip_ws(hparse *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

/* What the parser saw where it stopped, for messages: the next few characters or "end of header". */
static const char *near(const hparse *c, char *buf, size_t bufsz)
{
    if (c->p >= c->end) return "the end of the header";
    size_t n = 0;
    buf[n++] = '\'';
    for (const char *q = c->p; q < c->end && n + 2 < bufsz && n < 13; q++)
        buf[n++] = (*q >= 0x20 && *q < 0x7f) ? *q : '?';
    buf[n++] = '\'';
    buf[n] = '\0';
    return buf;
}

static int syntax_error(hparse *c, const char *expected)
{
    char buf[24];
    set_err(c->err, c->errsz, c->path, "malformed header: expected %s at %s (header byte %td)", expected,
            near(c, buf, sizeof buf), c->p - c->start);
    return -1;
}

/* A Python string literal without escapes (none of the strings kvq accepts has any). Stores up to outsz-1
 * characters; *truncated tells whether it was longer. */
static int parse_string(hparse *c, char *out, size_t outsz, int *truncated)
{
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return syntax_error(c, "a quoted string");
    char quote = *c->p++;
    size_t n = 0;
    *truncated = 0;
    while (c->p < c->end && *c->p != quote) {
        if (*c->p == '\n' || *c->p == '\\') return syntax_error(c, "a plain string (no escapes or newlines)");
        if (n + 1 < outsz)
            out[n++] = *c->p;
        else
            *truncated = 1;
        c->p++;
    }
    if (c->p >= c->end) return syntax_error(c, "the closing quote of a string");
    c->p++;
    out[n] = '\0';
    return 0;
}

static int parse_bool(hparse *c, int *out)
{
    if (c->end - c->p >= 4 && memcmp(c->p, "True", 4) == 0) {
        c->p += 4;
        *out = 1;
    } else if (c->end - c->p >= 5 && memcmp(c->p, "False", 5) == 0) {
        c->p += 5;
        *out = 0;
    } else {
        char buf[24];
        set_err(c->err, c->errsz, c->path, "malformed header: 'fortran_order' must be True or False, found %s",
                near(c, buf, sizeof buf));
        return -1;
    }
    /* "Truex" is a name, not True */
    if (c->p < c->end && ((*c->p >= 'a' && *c->p <= 'z') || (*c->p >= 'A' && *c->p <= 'Z') || *c->p == '_'))
        return syntax_error(c, "',' or '}' after the boolean");
    return 0;
}

/* One dimension: a non-negative decimal integer, optionally with Python 2's 'L' suffix (old NumPy wrote it). */
static int parse_dim(hparse *c, size_t *out)
{
    int negative = 0;
    if (c->p < c->end && *c->p == '-') {
        negative = 1;
        c->p++;
    }
    if (c->p >= c->end || *c->p < '0' || *c->p > '9') return syntax_error(c, "an integer dimension in 'shape'");
    const char *start = c->p;
    uint64_t v = 0;
    int overflow = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        unsigned d = (unsigned)(*c->p - '0');
        if (v > (UINT64_MAX - d) / 10) overflow = 1;
        else v = v * 10 + d;
        c->p++;
    }
    int len = (int)(c->p - start);
    if (c->p < c->end && (*c->p == 'L' || *c->p == 'l')) c->p++;
    if (negative) {
        set_err(c->err, c->errsz, c->path, "invalid shape: negative dimension -%.*s", len, start);
        return -1;
    }
    if (overflow || v > SIZE_MAX || v > (uint64_t)INT64_MAX) {
        set_err(c->err, c->errsz, c->path, "invalid shape: dimension %.*s is too large", len, start);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

static int parse_shape(hparse *c, hdr *h)
{
    if (c->p >= c->end || *c->p != '(') {
        char buf[24];
        set_err(c->err, c->errsz, c->path, "malformed header: 'shape' must be a tuple of integers, found %s",
                near(c, buf, sizeof buf));
        return -1;
    }
    c->p++;
    int n = 0, trailing_comma = 0;
    for (;;) {
        skip_ws(c);
        if (c->p < c->end && *c->p == ')') break;
        size_t d = 0;
        if (parse_dim(c, &d)) return -1;
        if (n == KVQ_NPY_MAX_DIMS) {
            set_err(c->err, c->errsz, c->path, "unsupported shape: more than %d dimensions", KVQ_NPY_MAX_DIMS);
            return -1;
        }
        h->shape[n++] = d;
        skip_ws(c);
        trailing_comma = 0;
        if (c->p < c->end && *c->p == ',') {
            trailing_comma = 1;
            c->p++;
            continue;
        }
        if (c->p < c->end && *c->p == ')') break;
        return syntax_error(c, "',' or ')' in 'shape'");
    }
    c->p++; /* ')' */
    if (n == 1 && !trailing_comma) {
        /* (5) is Python for the integer 5, not a tuple: NumPy's reader rejects it too. */
        set_err(c->err, c->errsz, c->path, "malformed header: 'shape' (%zu) is not a tuple (write (%zu,))",
                h->shape[0], h->shape[0]);
        return -1;
    }
    h->ndim = n;
    return 0;
}

static int parse_header_dict(hparse *c, hdr *h)
{
    skip_ws(c);
    if (c->p >= c->end || *c->p != '{') return syntax_error(c, "'{' opening the header dict");
    c->p++;
    for (;;) {
        skip_ws(c);
        if (c->p < c->end && *c->p == '}') break;
        char key[32];
        int truncated;
        if (parse_string(c, key, sizeof key, &truncated)) return -1;
        skip_ws(c);
        if (c->p >= c->end || *c->p != ':') return syntax_error(c, "':' after a key");
        c->p++;
        skip_ws(c);
        int *have;
        int rc;
        if (!truncated && strcmp(key, "descr") == 0) {
            have = &h->have_descr;
            if (c->p < c->end && *c->p == '[') {
                set_err(c->err, c->errsz, c->path,
                        "unsupported dtype: structured arrays (a list 'descr') are not supported");
                return -1;
            }
            rc = parse_string(c, h->descr, sizeof h->descr, &h->descr_truncated);
        } else if (!truncated && strcmp(key, "fortran_order") == 0) {
            have = &h->have_fortran;
            rc = parse_bool(c, &h->fortran);
        } else if (!truncated && strcmp(key, "shape") == 0) {
            have = &h->have_shape;
            rc = parse_shape(c, h);
        } else {
            set_err(c->err, c->errsz, c->path,
                    "malformed header: unexpected key '%s%s' (a .npy header has exactly 'descr', 'fortran_order' "
                    "and 'shape')",
                    key, truncated ? "..." : "");
            return -1;
        }
        if (rc) return -1;
        if (*have) {
            set_err(c->err, c->errsz, c->path, "malformed header: duplicate key '%s'", key);
            return -1;
        }
        *have = 1;
        skip_ws(c);
        if (c->p < c->end && *c->p == ',') {
            c->p++;
            continue;
        }
        if (c->p < c->end && *c->p == '}') break;
        return syntax_error(c, "',' or '}' after a value");
    }
    c->p++; /* '}' */
    skip_ws(c);
    if (c->p != c->end) return syntax_error(c, "only padding after the header dict");
    const char *missing = !h->have_descr     ? "descr"
                          : !h->have_fortran ? "fortran_order"
                          : !h->have_shape   ? "shape"
                                             : NULL;
    if (missing) {
        set_err(c->err, c->errsz, c->path, "malformed header: missing key '%s'", missing);
        return -1;
    }
    return 0;
}

/* Maps descr to a dtype and byte order; -1 with a message for anything else. */
static int dtype_from_descr(const hdr *h, const char *path, kvq_dtype *dt, int *big_endian, char *err,
                            size_t errsz)
{
    static const struct {
        const char *descr;
        kvq_dtype dt;
        int big;
    } known[] = {
        {"<f4", KVQ_F32, 0}, {">f4", KVQ_F32, 1}, {"<f2", KVQ_F16, 0},
        {">f2", KVQ_F16, 1}, {"<V2", KVQ_BF16, 0}, /* ml_dtypes.bfloat16 under np.save */
    };
    for (size_t i = 0; !h->descr_truncated && i < sizeof known / sizeof known[0]; i++) {
        if (strcmp(h->descr, known[i].descr) == 0) {
            *dt = known[i].dt;
            *big_endian = known[i].big;
            return 0;
        }
    }
    set_err(err, errsz, path,
            "unsupported dtype '%s%s': kvq reads float32 ('<f4'), float16 ('<f2'), bfloat16 saved by ml_dtypes "
            "('<V2') and big-endian '>f4'/'>f2'; convert with a.astype(np.float32)",
            h->descr, h->descr_truncated ? "..." : "");
    return -1;
}

/* ---- reading ---------------------------------------------------------------------------------------------- */

static size_t read_full(FILE *f, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        size_t r = fread((char *)buf + got, 1, n - got, f);
        if (r == 0) break;
        got += r;
    }
    return got;
}

static uint32_t load_u32(const unsigned char *b, int big)
{
    if (big) return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3];
    return (uint32_t)b[3] << 24 | (uint32_t)b[2] << 16 | (uint32_t)b[1] << 8 | b[0];
}

static uint16_t load_u16(const unsigned char *b, int big)
{
    return big ? (uint16_t)(b[0] << 8 | b[1]) : (uint16_t)(b[1] << 8 | b[0]);
}

static void decode(float *dst, const unsigned char *src, size_t n, kvq_dtype dt, int big)
{
    for (size_t i = 0; i < n; i++) {
        if (dt == KVQ_F32) {
            uint32_t u = load_u32(src + 4 * i, big);
            memcpy(&dst[i], &u, sizeof u);
        } else {
            uint16_t u = load_u16(src + 2 * i, big);
            dst[i] = dt == KVQ_F16 ? kvq_f32_from_f16(u) : kvq_f32_from_bf16(u);
        }
    }
}

/* Everything after fopen; the caller closes f. header_only: stop after the header's checks (out->data NULL). */
static kvq_status read_stream(FILE *f, const char *path, kvq_npy *out, int header_only, char *err, size_t errsz)
{
    /* The file's size, when it has one (a regular file), lets every length be checked before anything is
     * allocated; for a pipe the checks happen as the bytes arrive. */
    struct stat st;
    int sized = 0;
    uint64_t file_size = 0;
    if (fstat(fileno(f), &st) == 0) {
        if (S_ISDIR(st.st_mode)) {
            set_err(err, errsz, path, "cannot read: is a directory");
            return KVQ_ERR_IO;
        }
        if (S_ISREG(st.st_mode)) {
            sized = 1;
            file_size = (uint64_t)st.st_size;
        }
    }

    unsigned char pre[12];
    size_t got = read_full(f, pre, 8);
    if (ferror(f)) goto read_error;
    if (got == 0) {
        set_err(err, errsz, path, "truncated: the file is empty (not a .npy file)");
        return KVQ_ERR_FORMAT;
    }
    if (memcmp(pre, MAGIC, got < MAGIC_LEN ? got : MAGIC_LEN) != 0) {
        set_err(err, errsz, path, "not a .npy file: bad magic string (the file must start with \\x93NUMPY)");
        return KVQ_ERR_FORMAT;
    }
    if (got < 8) {
        set_err(err, errsz, path, "truncated: the file ends after %zu bytes, inside the .npy preamble", got);
        return KVQ_ERR_FORMAT;
    }
    int major = pre[6], minor = pre[7];
    if (major < 1 || major > 3 || minor != 0) {
        set_err(err, errsz, path, "unsupported .npy format version %d.%d (kvq reads 1.0, 2.0 and 3.0)", major,
                minor);
        return KVQ_ERR_FORMAT;
    }
    size_t len_bytes = major == 1 ? 2 : 4;
    size_t got2 = read_full(f, pre + 8, len_bytes);
    if (ferror(f)) goto read_error;
    if (got2 < len_bytes) {
        set_err(err, errsz, path, "truncated: the file ends after %zu bytes, inside the .npy preamble", 8 + got2);
        return KVQ_ERR_FORMAT;
    }
    uint64_t header_len = major == 1 ? load_u16(pre + 8, 0) : load_u32(pre + 8, 0);
    uint64_t data_start = 8 + len_bytes + header_len;
    if (sized && data_start > file_size) {
        set_err(err, errsz, path,
                "truncated: the header length field says %llu bytes, but the file ends %llu bytes into it",
                (unsigned long long)header_len, (unsigned long long)(file_size - 8 - len_bytes));
        return KVQ_ERR_FORMAT;
    }
    if (header_len > MAX_HEADER_LEN) {
        set_err(err, errsz, path, "malformed header: header length %llu is implausibly large",
                (unsigned long long)header_len);
        return KVQ_ERR_FORMAT;
    }

    char *text = kvq_malloc((size_t)header_len + 1);
    if (!text) {
        set_err(err, errsz, path, "out of memory reading the header");
        return KVQ_ERR_NOMEM;
    }
    size_t hgot = read_full(f, text, (size_t)header_len);
    if (ferror(f)) {
        kvq_free(text);
        goto read_error;
    }
    if (hgot < header_len) {
        kvq_free(text);
        set_err(err, errsz, path,
                "truncated: the header length field says %llu bytes, but the file ends %zu bytes into it",
                (unsigned long long)header_len, hgot);
        return KVQ_ERR_FORMAT;
    }
    text[header_len] = '\0';
    hdr h;
    memset(&h, 0, sizeof h);
    hparse c = {text, text + header_len, text, path, err, errsz};
    int bad = parse_header_dict(&c, &h);
    kvq_free(text);
    if (bad) return KVQ_ERR_FORMAT;

    kvq_dtype dt;
    int big;
    if (dtype_from_descr(&h, path, &dt, &big, err, errsz)) return KVQ_ERR_FORMAT;
    if (h.fortran) {
        set_err(err, errsz, path,
                "fortran_order is True (column-major data); kvq reads C order only: save np.ascontiguousarray(a)");
        return KVQ_ERR_FORMAT;
    }

    /* count = product of the shape; an empty dimension makes it 0 whatever the others are (as in NumPy). */
    size_t isz = item_size(dt), count = 1;
    int empty = 0;
    for (int i = 0; i < h.ndim; i++) empty |= h.shape[i] == 0;
    if (empty) {
        count = 0;
    } else {
        size_t limit = SIZE_MAX / (isz > sizeof(float) ? isz : sizeof(float));
        for (int i = 0; i < h.ndim; i++) {
            if (count > limit / h.shape[i]) {
                set_err(err, errsz, path, "invalid shape: the product of the dimensions overflows");
                return KVQ_ERR_FORMAT;
            }
            count *= h.shape[i];
        }
    }
    uint64_t need = (uint64_t)count * isz;
    if (sized && file_size - data_start != need) {
        uint64_t have = file_size - data_start;
        if (have < need)
            set_err(err, errsz, path,
                    "truncated data: expected %llu bytes (%zu %s values) after the %llu-byte header, found %llu",
                    (unsigned long long)need, count, kvq_npy_dtype_name(dt), (unsigned long long)data_start,
                    (unsigned long long)have);
        else
            set_err(err, errsz, path, "trailing data: %llu bytes after the %llu bytes of array data",
                    (unsigned long long)(have - need), (unsigned long long)need);
        return KVQ_ERR_FORMAT;
    }

    if (header_only) {
        out->dtype = dt;
        out->ndim = h.ndim;
        memcpy(out->shape, h.shape, sizeof h.shape);
        out->count = count;
        return KVQ_OK;
    }
    /* A file's size was checked against the header above, so its data is allocated at once. A stream (a pipe)
     * has no size: its buffer grows as the data arrives (doubling from 1 MiB), so memory stays proportional to
     * what was read, not to what the header claims (a 64 GiB claim on an empty pipe once allocated 64 GiB). */
    size_t cap = sized ? count : (count < STREAM_FIRST_VALUES ? count : STREAM_FIRST_VALUES);
    float *data = kvq_malloc((cap ? cap : 1) * sizeof(float));
    if (!data) {
        set_err(err, errsz, path, "out of memory for %zu values", cap);
        return KVQ_ERR_NOMEM;
    }
    unsigned char buf[CHUNK_BYTES];
    size_t done = 0;
    while (done < count) {
        size_t n = count - done < CHUNK_BYTES / isz ? count - done : CHUNK_BYTES / isz;
        if (done + n > cap) {
            size_t grow = cap > count / 2 ? count : 2 * cap;
            float *d2 = kvq_realloc(data, grow * sizeof(float));
            if (!d2) {
                kvq_free(data);
                set_err(err, errsz, path, "out of memory for %zu values", grow);
                return KVQ_ERR_NOMEM;
            }
            data = d2;
            cap = grow;
        }
        size_t b = read_full(f, buf, n * isz);
        if (b < n * isz) {
            kvq_free(data);
            if (ferror(f)) goto read_error;
            set_err(err, errsz, path, "truncated data: expected %llu bytes after the %llu-byte header, found %llu",
                    (unsigned long long)need, (unsigned long long)data_start,
                    (unsigned long long)(done * isz + b));
            return KVQ_ERR_FORMAT;
        }
        decode(data + done, buf, n, dt, big);
        done += n;
    }
    if (!sized && fgetc(f) != EOF) {
        kvq_free(data);
        set_err(err, errsz, path, "trailing data after the %llu bytes of array data", (unsigned long long)need);
        return KVQ_ERR_FORMAT;
    }
    if (ferror(f)) {
        kvq_free(data);
        goto read_error;
    }

    out->dtype = dt;
    out->ndim = h.ndim;
    memcpy(out->shape, h.shape, sizeof h.shape);
    out->count = count;
    out->data = data;
    return KVQ_OK;

read_error:
    set_err(err, errsz, path, "read error: %s", strerror(errno));
    return KVQ_ERR_IO;
}

static kvq_status read_path(const char *path, kvq_npy *out, int header_only, char *err, size_t errsz)
{
    if (err && errsz) err[0] = '\0';
    if (out) memset(out, 0, sizeof *out);
    if (!path || !out) {
        set_err(err, errsz, path, "kvq_npy_read: NULL %s", path ? "output" : "path");
        return KVQ_ERR_INVALID;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_err(err, errsz, path, "cannot open: %s", strerror(errno));
        return KVQ_ERR_IO;
    }
    kvq_status st = read_stream(f, path, out, header_only, err, errsz);
    fclose(f); /* read-only: nothing to lose if closing fails */
    return st;
}

kvq_status kvq_npy_read(const char *path, kvq_npy *out, char *err, size_t errsz)
{
    return read_path(path, out, 0, err, errsz);
}

kvq_status kvq_npy_read_header(const char *path, kvq_npy *out, char *err, size_t errsz)
{
    return read_path(path, out, 1, err, errsz);
}

/* ---- writing ---------------------------------------------------------------------------------------------- */

static void store(unsigned char *dst, const float *src, size_t n, kvq_dtype dt)
{
    for (size_t i = 0; i < n; i++) {
        if (dt == KVQ_F32) {
            uint32_t u;
            memcpy(&u, &src[i], sizeof u);
            dst[4 * i] = (unsigned char)u;
            dst[4 * i + 1] = (unsigned char)(u >> 8);
            dst[4 * i + 2] = (unsigned char)(u >> 16);
            dst[4 * i + 3] = (unsigned char)(u >> 24);
        } else {
            uint16_t u = dt == KVQ_F16 ? kvq_f16_from_f32(src[i]) : kvq_bf16_from_f32(src[i]);
            dst[2 * i] = (unsigned char)u;
            dst[2 * i + 1] = (unsigned char)(u >> 8);
        }
    }
}

/* The 1.0 preamble and header as NumPy writes it: the dict, spaces, '\n', the whole a multiple of 64 bytes so
 * the data is aligned for memory mapping. Returns the total length. */
static size_t format_header(unsigned char *buf, size_t bufsz, kvq_dtype dt, const size_t *shape, int ndim)
{
    const char *descr = dt == KVQ_F32 ? "<f4" : dt == KVQ_F16 ? "<f2" : "<V2";
    char dict[512];
    size_t n = (size_t)snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': False, 'shape': (",
                                descr);
    for (int i = 0; i < ndim; i++)
        n += (size_t)snprintf(dict + n, sizeof dict - n, "%s%zu", i ? ", " : "", shape[i]);
    n += (size_t)snprintf(dict + n, sizeof dict - n, "%s), }", ndim == 1 ? "," : "");
    size_t total = (10 + n + 1 + 63) / 64 * 64; /* preamble 10, dict, at least the '\n' */
    if (total > bufsz) return 0;
    size_t header_len = total - 10;
    memcpy(buf, MAGIC, MAGIC_LEN);
    buf[6] = 1;
    buf[7] = 0;
    buf[8] = (unsigned char)header_len;
    buf[9] = (unsigned char)(header_len >> 8);
    memcpy(buf + 10, dict, n);
    memset(buf + 10 + n, ' ', header_len - n - 1);
    buf[total - 1] = '\n';
    return total;
}

kvq_status kvq_npy_write(const char *path, kvq_dtype dtype, const size_t *shape, int ndim, const float *data,
                         char *err, size_t errsz)
{
    if (err && errsz) err[0] = '\0';
    if (!path) {
        set_err(err, errsz, path, "kvq_npy_write: NULL path");
        return KVQ_ERR_INVALID;
    }
    if (!kvq_npy_dtype_name(dtype)) {
        set_err(err, errsz, path, "kvq_npy_write: unknown dtype %d", (int)dtype);
        return KVQ_ERR_INVALID;
    }
    if (ndim < 0 || ndim > KVQ_NPY_MAX_DIMS || (ndim > 0 && !shape)) {
        set_err(err, errsz, path, "kvq_npy_write: bad shape (%d dimensions; at most %d)", ndim, KVQ_NPY_MAX_DIMS);
        return KVQ_ERR_INVALID;
    }
    size_t isz = item_size(dtype), count = 1;
    int empty = 0;
    for (int i = 0; i < ndim; i++) empty |= shape[i] == 0;
    for (int i = 0; !empty && i < ndim; i++) {
        if (count > SIZE_MAX / sizeof(float) / shape[i]) {
            set_err(err, errsz, path, "kvq_npy_write: the product of the dimensions overflows");
            return KVQ_ERR_INVALID;
        }
        count *= shape[i];
    }
    if (empty) count = 0;
    if (count && !data) {
        set_err(err, errsz, path, "kvq_npy_write: NULL data for %zu values", count);
        return KVQ_ERR_INVALID;
    }

    unsigned char buf[CHUNK_BYTES];
    size_t hlen = format_header(buf, sizeof buf, dtype, shape, ndim);
    FILE *f = fopen(path, "wb");
    if (!f) {
        set_err(err, errsz, path, "cannot open for writing: %s", strerror(errno));
        return KVQ_ERR_IO;
    }
    /* Only a regular file is removed after a failure: the path may name a device or a pipe. */
    struct stat st;
    int regular = fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode);
    int ok = fwrite(buf, 1, hlen, f) == hlen;
    for (size_t done = 0; ok && done < count;) {
        size_t n = count - done < CHUNK_BYTES / isz ? count - done : CHUNK_BYTES / isz;
        store(buf, data + done, n, dtype);
        ok = fwrite(buf, 1, n * isz, f) == n * isz;
        done += n;
    }
    int saved = errno;
    if (fclose(f) != 0 && ok) {
        ok = 0;
        saved = errno;
    }
    if (!ok) {
        if (regular) remove(path);
        set_err(err, errsz, path, "write error: %s", strerror(saved));
        return KVQ_ERR_IO;
    }
    return KVQ_OK;
}
