/* The public Specs API: read a spec file (or a string), expand its includes, parse every file, resolve the
 * schemes, and keep what survives (schemes, diagnostics, their strings) in a kvq_spec. The syntax trees and the
 * file texts are freed before returning. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "alloc.h"
#include "ast.h"
#include "diag.h"
#include "kvq.h"
#include "scheme.h"
#include "sema.h"

#define SPEC_FILE_MAX (64u << 20)
#define SPEC_INCLUDE_DEPTH 16

struct kvq_spec {
    ast_arena arena; /* file names, messages, snippets */
    diag_list diags;
    kvq_scheme *schemes;
    int n_schemes;
};

typedef struct {
    diag_src src;
    char *owned; /* the text when read from disk */
    dev_t dev;
    ino_t ino;
    int has_id;      /* a file on disk (a string has no identity) */
    int string_root; /* includes of a parsed string resolve relative to the current directory */
    int state;       /* 1: being read (its includes are being expanded), 2: done */
} lfile;

typedef struct {
    kvq_spec *spec;
    ast_arena ast;
    lfile **files;
    int n_files, cap_files;
    sema_decl *decls;
    int n_decls, cap_decls;
    int nomem;
    int io_error; /* the root file could not be read */
} loader;

static const char *intern(loader *L, const char *s)
{
    char *d = ast_strndup(&L->spec->arena, s, strlen(s));
    if (!d) L->nomem = 1;
    return d;
}

/* 0: read; -1: out of memory; -2: too large; > 0: errno. */
static int read_all(FILE *fp, char **out, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = kvq_malloc(cap);
    if (!buf) return -1;
    for (;;) {
        size_t got;
        if (cap - n < 2) {
            char *b2;
            if (cap >= SPEC_FILE_MAX) {
                kvq_free(buf);
                return -2;
            }
            cap *= 2;
            b2 = kvq_realloc(buf, cap);
            if (!b2) {
                kvq_free(buf);
                return -1;
            }
            buf = b2;
        }
        got = fread(buf + n, 1, cap - n - 1, fp);
        n += got;
        if (got == 0) {
            if (ferror(fp)) {
                int e = errno ? errno : EIO;
                kvq_free(buf);
                return e;
            }
            break;
        }
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return 0;
}

/* Opens a spec file for reading: non-blocking, so a FIFO or a device never blocks the open, and only when it is
 * a regular file no larger than the limit (include "/dev/zero" once read 64 MiB before refusing; a FIFO blocked
 * forever). 0: *fp open; > 0: errno; -2: too large; -3: not a regular file; -4: a directory. */
static int open_spec(const char *path, FILE **fp, struct stat *st)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return errno ? errno : EIO;
    int rc = 0;
    if (fstat(fd, st) != 0)
        rc = errno ? errno : EIO;
    else if (S_ISDIR(st->st_mode))
        rc = -4;
    else if (!S_ISREG(st->st_mode))
        rc = -3;
    else if ((unsigned long long)st->st_size > SPEC_FILE_MAX)
        rc = -2;
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        rc = errno ? errno : EIO;
    if (rc == 0 && !(*fp = fdopen(fd, "rb"))) rc = errno ? errno : ENOMEM;
    if (rc != 0) close(fd);
    return rc;
}

/* The reason for a read_all / open_spec code. */
static const char *read_error(int rc)
{
    if (rc == -2) return "file is larger than the 64 MiB limit";
    if (rc == -3) return "not a regular file (a FIFO or a device)";
    if (rc == -4) return strerror(EISDIR);
    return strerror(rc);
}

static lfile *add_file(loader *L)
{
    lfile *f;
    if (L->n_files == L->cap_files) {
        int cap = L->cap_files ? L->cap_files * 2 : 8;
        lfile **v = kvq_realloc(L->files, (size_t)cap * sizeof *v);
        if (!v) {
            L->nomem = 1;
            return NULL;
        }
        L->files = v;
        L->cap_files = cap;
    }
    f = kvq_calloc(1, sizeof *f);
    if (!f) {
        L->nomem = 1;
        return NULL;
    }
    L->files[L->n_files++] = f;
    return f;
}

static void add_decl(loader *L, const ast_item *it, const diag_src *src)
{
    if (L->n_decls >= SEMA_SCHEMES_MAX) {
        if (L->n_decls == SEMA_SCHEMES_MAX)
            ast_diag_add(&L->spec->diags, KVQ_DIAG_ERROR, src, it->loc.line, it->loc.col,
                         "too many schemes (at most %d in one spec)", SEMA_SCHEMES_MAX);
        L->n_decls = SEMA_SCHEMES_MAX + 1; /* reported once */
        return;
    }
    if (L->n_decls == L->cap_decls) {
        int cap = L->cap_decls ? L->cap_decls * 2 : 8;
        sema_decl *v = kvq_realloc(L->decls, (size_t)cap * sizeof *v);
        if (!v) {
            L->nomem = 1;
            return;
        }
        L->decls = v;
        L->cap_decls = cap;
    }
    L->decls[L->n_decls].item = it;
    L->decls[L->n_decls].src = src;
    L->n_decls++;
}

static void process(loader *L, lfile *f, int depth);

/* `include "name";` in file `from`: name is relative to the directory of from (or the current directory for a
 * parsed string). A file already included is skipped (each file is read once); one that is still being read is
 * a cycle. */
static void include(loader *L, const lfile *from, const ast_item *it, int depth)
{
    diag_list *dl = &L->spec->diags;
    const char *name = it->name;
    char path[4096], q[64];
    size_t dir = 0;
    FILE *fp;
    struct stat st;
    lfile *f;
    int rc;

    if (depth >= SPEC_INCLUDE_DEPTH) {
        ast_diag_add(dl, KVQ_DIAG_ERROR, &from->src, it->loc.line, it->loc.col,
                     "includes nested too deeply (more than %d levels)", SPEC_INCLUDE_DEPTH);
        return;
    }
    if (name[0] != '/' && !from->string_root) {
        const char *slash = strrchr(from->src.file, '/');
        if (slash) dir = (size_t)(slash - from->src.file) + 1;
    }
    if (dir + strlen(name) + 1 > sizeof path) {
        ast_diag_add(dl, KVQ_DIAG_ERROR, &from->src, it->name_loc.line, it->name_loc.col, "include path is too long");
        return;
    }
    memcpy(path, from->src.file, dir);
    strcpy(path + dir, name);

    fp = NULL;
    rc = open_spec(path, &fp, &st);
    if (rc != 0) {
        ast_diag_add(dl, KVQ_DIAG_ERROR, &from->src, it->name_loc.line, it->name_loc.col,
                     "cannot %s included file '%s': %s", rc < 0 ? "read" : "open", ast_diag_quote(q, sizeof q, path, 48),
                     read_error(rc));
        return;
    }
    int have_id = 1;
    if (have_id) {
        for (int i = 0; i < L->n_files; i++) {
            const lfile *o = L->files[i];
            if (!o->has_id || o->dev != st.st_dev || o->ino != st.st_ino) continue;
            if (o->state == 1)
                ast_diag_add(dl, KVQ_DIAG_ERROR, &from->src, it->name_loc.line, it->name_loc.col,
                             "include cycle: '%s' is already being read", ast_diag_quote(q, sizeof q, path, 48));
            fclose(fp);
            return;
        }
    }
    if (!(f = add_file(L))) {
        fclose(fp);
        return;
    }
    if (have_id) {
        f->has_id = 1;
        f->dev = st.st_dev;
        f->ino = st.st_ino;
    }
    rc = read_all(fp, &f->owned, &f->src.len);
    fclose(fp);
    if (rc == -1) {
        L->nomem = 1;
        return;
    }
    if (rc != 0) {
        ast_diag_add(dl, KVQ_DIAG_ERROR, &from->src, it->name_loc.line, it->name_loc.col,
                     "cannot read included file '%s': %s", ast_diag_quote(q, sizeof q, path, 48), read_error(rc));
        f->has_id = 0;
        return;
    }
    f->src.text = f->owned;
    if (!(f->src.file = intern(L, path))) return;
    process(L, f, depth + 1);
}

static void process(loader *L, lfile *f, int depth)
{
    ast_parser p;
    memset(&p, 0, sizeof p);
    p.arena = &L->ast;
    p.diags = &L->spec->diags;
    p.src = &f->src;
    /* One scheme past the spec's limit is enough for add_decl to report "too many schemes". */
    p.max_schemes = SEMA_SCHEMES_MAX + 1 - (L->n_decls < SEMA_SCHEMES_MAX ? L->n_decls : SEMA_SCHEMES_MAX);
    f->state = 1;
    if (ast_parse(&p) < 0 || p.nomem) {
        L->nomem = 1;
        return;
    }
    for (const ast_item *it = p.items.head; it && !L->nomem && !L->spec->diags.stopped && L->n_decls <= SEMA_SCHEMES_MAX;
         it = it->next) {
        if (it->kind == AST_ITEM_INCLUDE)
            include(L, f, it, depth);
        else
            add_decl(L, it, &f->src);
    }
    f->state = 2;
}

/* Diagnostics are found in two passes (syntax while parsing, meaning while resolving); users read them in
 * source order: by file (in the order files were read), line and column. A final "too many errors" stays
 * last. Insertion sort: the list is short (DIAG_MAX_TOTAL) and mostly sorted. */
static int file_rank(const loader *L, const char *file)
{
    for (int i = 0; i < L->n_files; i++)
        if (L->files[i]->src.file == file) return i;
    return -1;
}

static int diag_before(const loader *L, const kvq_diag *a, const kvq_diag *b)
{
    int fa = file_rank(L, a->file), fb = file_rank(L, b->file);
    if (fa != fb) return fa < fb;
    if (a->line != b->line) return a->line < b->line;
    return a->col < b->col;
}

static void sort_diags(const loader *L, diag_list *dl)
{
    int n = dl->stopped ? dl->n - 1 : dl->n;
    for (int i = 1; i < n; i++) {
        kvq_diag d = dl->v[i];
        int j = i;
        while (j > 0 && diag_before(L, &d, &dl->v[j - 1])) {
            dl->v[j] = dl->v[j - 1];
            j--;
        }
        dl->v[j] = d;
    }
}

static void loader_free(loader *L)
{
    for (int i = 0; i < L->n_files; i++) {
        kvq_free(L->files[i]->owned);
        kvq_free(L->files[i]);
    }
    kvq_free(L->files);
    kvq_free(L->decls);
    ast_arena_free(&L->ast);
}

void kvq_spec_free(kvq_spec *spec)
{
    if (!spec) return;
    ast_diag_free(&spec->diags);
    ast_arena_free(&spec->arena);
    kvq_free(spec->schemes);
    kvq_free(spec);
}

/* Parses the root file (text given, or read from path), resolves, and decides the status. */
static kvq_status parse_root(const char *name, const char *text, size_t len, kvq_spec **out)
{
    loader L;
    kvq_spec *spec;
    lfile *root;
    kvq_status status;

    memset(&L, 0, sizeof L);
    spec = kvq_calloc(1, sizeof *spec);
    if (!spec) return KVQ_ERR_NOMEM;
    spec->diags.arena = &spec->arena;
    L.spec = spec;

    if ((root = add_file(&L)) && (root->src.file = intern(&L, name))) {
        if (text) {
            root->src.text = text;
            root->src.len = len;
            root->string_root = 1;
            process(&L, root, 0);
        } else {
            FILE *fp = NULL;
            struct stat st;
            int rc = open_spec(name, &fp, &st);
            int open_failed = rc > 0; /* the message says "cannot open" only then, else "cannot read" */
            if (rc == 0) {
                root->has_id = 1;
                root->dev = st.st_dev;
                root->ino = st.st_ino;
            }
            if (fp) {
                rc = read_all(fp, &root->owned, &root->src.len);
                fclose(fp);
            }
            if (rc == -1) {
                L.nomem = 1;
            } else if (rc != 0) {
                ast_diag_add(&spec->diags, KVQ_DIAG_ERROR, &root->src, 0, 0, "cannot %s file: %s",
                             open_failed ? "open" : "read", read_error(rc));
                L.io_error = 1;
            } else {
                root->src.text = root->owned;
                process(&L, root, 0);
            }
        }
    }
    if (!L.nomem && L.n_decls > 0) {
        int n = L.n_decls > SEMA_SCHEMES_MAX ? SEMA_SCHEMES_MAX : L.n_decls;
        spec->schemes = kvq_calloc((size_t)n, sizeof *spec->schemes);
        if (!spec->schemes || sema_resolve(&spec->diags, L.decls, n, spec->schemes) < 0)
            L.nomem = 1;
        else
            spec->n_schemes = n;
    }
    sort_diags(&L, &spec->diags);
    loader_free(&L);
    if (L.nomem || spec->diags.nomem) {
        kvq_spec_free(spec);
        return KVQ_ERR_NOMEM;
    }
    status = L.io_error ? KVQ_ERR_IO : spec->diags.n_errors ? KVQ_ERR_SPEC : KVQ_OK;
    *out = spec;
    return status;
}

kvq_status kvq_spec_parse_file(const char *path, kvq_spec **out)
{
    if (!out) return KVQ_ERR_INVALID;
    *out = NULL;
    if (!path) return KVQ_ERR_INVALID;
    return parse_root(path, NULL, 0, out);
}

kvq_status kvq_spec_parse_string(const char *name, const char *text, size_t len, kvq_spec **out)
{
    if (!out) return KVQ_ERR_INVALID;
    *out = NULL;
    if (!text && len) return KVQ_ERR_INVALID;
    return parse_root(name ? name : "<string>", text ? text : "", len, out);
}

int kvq_spec_diag_count(const kvq_spec *spec) { return spec ? spec->diags.n : 0; }

const kvq_diag *kvq_spec_diag(const kvq_spec *spec, int i)
{
    if (!spec || i < 0 || i >= spec->diags.n) return NULL;
    return &spec->diags.v[i];
}

int kvq_spec_error_count(const kvq_spec *spec) { return spec ? spec->diags.n_errors : 0; }

int kvq_spec_scheme_count(const kvq_spec *spec) { return spec ? spec->n_schemes : 0; }

const kvq_scheme *kvq_spec_scheme_at(const kvq_spec *spec, int i)
{
    if (!spec || i < 0 || i >= spec->n_schemes) return NULL;
    return &spec->schemes[i];
}

const kvq_scheme *kvq_spec_scheme(const kvq_spec *spec, const char *name)
{
    if (!spec) return NULL;
    if (!name) return spec->n_schemes == 1 ? &spec->schemes[0] : NULL;
    for (int i = 0; i < spec->n_schemes; i++)
        if (!strcmp(spec->schemes[i].name, name)) return &spec->schemes[i];
    return NULL;
}

const char *kvq_scheme_name(const kvq_scheme *scheme) { return scheme ? scheme->name : NULL; }
