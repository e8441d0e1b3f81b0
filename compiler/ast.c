#include "ast.h"

#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"

/* ---------------------------------------------------------------------------------------------------------- */
/* Arena */

struct ast_chunk {
    ast_chunk *next;
    size_t used, cap;
    alignas(max_align_t) unsigned char data[];
};

enum { CHUNK_SIZE = 8192 };

void *ast_alloc(ast_arena *a, size_t n)
{
    const size_t align = alignof(max_align_t);
    ast_chunk *c = a->head;
    void *p;

    n = (n + align - 1) & ~(align - 1);
    if (n == 0) n = align;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > CHUNK_SIZE ? n : CHUNK_SIZE;
        c = kvq_malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->cap = cap;
        c->used = 0;
        /* A big request gets its own chunk behind the current one, so the current one keeps filling. */
        if (a->head && cap > CHUNK_SIZE) {
            c->next = a->head->next;
            a->head->next = c;
        } else {
            c->next = a->head;
            a->head = c;
        }
    }
    p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *ast_strndup(ast_arena *a, const char *s, size_t n)
{
    char *d = ast_alloc(a, n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

void ast_arena_free(ast_arena *a)
{
    ast_chunk *c = a->head;
    while (c) {
        ast_chunk *next = c->next;
        kvq_free(c);
        c = next;
    }
    a->head = NULL;
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Grammar actions */

static void *node(ast_parser *p, size_t n)
{
    void *v;
    if (p->nomem) return NULL;
    v = ast_alloc(p->arena, n);
    if (!v) p->nomem = 1;
    return v;
}

ast_item *ast_scheme(ast_parser *p, ast_loc kw, const ast_tok *name, ast_loc name_loc, const ast_tok *parent,
                     ast_loc parent_loc, ast_block *block)
{
    ast_item *it;
    if (!name || !name->text || !block) return NULL;
    if (!(it = node(p, sizeof *it))) return NULL;
    it->kind = AST_ITEM_SCHEME;
    it->loc = kw;
    it->name = name->text;
    it->name_loc = name_loc;
    it->parent = parent ? parent->text : NULL;
    it->parent_loc = parent_loc;
    it->block = block;
    return it;
}

ast_item *ast_include(ast_parser *p, ast_loc kw, const ast_tok *path, ast_loc path_loc)
{
    ast_item *it;
    if (!path || !path->text) return NULL;
    if (!(it = node(p, sizeof *it))) return NULL;
    it->kind = AST_ITEM_INCLUDE;
    it->loc = kw;
    it->name = path->text;
    it->name_loc = path_loc;
    return it;
}

void ast_items_add(ast_parser *p, ast_item *it)
{
    if (!it) return;
    if (it->kind == AST_ITEM_SCHEME && p->max_schemes > 0 && ++p->n_schemes >= p->max_schemes) p->stop = 1;
    if (p->items.tail)
        p->items.tail->next = it;
    else
        p->items.head = it;
    p->items.tail = it;
}

ast_stmt *ast_words_start(ast_parser *p, const ast_tok *word, ast_loc loc)
{
    ast_stmt *s;
    if (!word || !word->text) return NULL;
    if (!(s = node(p, sizeof *s))) return NULL;
    s->name = word->text;
    s->loc = loc;
    return s;
}

ast_stmt *ast_words_add(ast_parser *p, ast_stmt *words, ast_arg *arg)
{
    (void)p;
    if (!words || !arg) return words;
    if (words->args_tail)
        words->args_tail->next = arg;
    else
        words->args = arg;
    words->args_tail = arg;
    words->n_args++;
    return words;
}

static ast_arg *arg_new(ast_parser *p, ast_arg_kind kind, const ast_tok *t, ast_loc loc)
{
    ast_arg *a;
    if (!t || !t->text) return NULL;
    if (!(a = node(p, sizeof *a))) return NULL;
    a->kind = kind;
    a->loc = loc;
    a->text = t->text;
    a->num = t->num;
    a->bad = t->bad;
    return a;
}

ast_arg *ast_arg_ident(ast_parser *p, const ast_tok *t, ast_loc loc) { return arg_new(p, AST_IDENT, t, loc); }
ast_arg *ast_arg_string(ast_parser *p, const ast_tok *t, ast_loc loc) { return arg_new(p, AST_STRING, t, loc); }
ast_arg *ast_arg_percent(ast_parser *p, const ast_tok *t, ast_loc loc) { return arg_new(p, AST_PERCENT, t, loc); }

ast_arg *ast_arg_number(ast_parser *p, const ast_tok *t, ast_loc loc)
{
    return arg_new(p, t && t->is_int ? AST_INT : AST_REAL, t, loc);
}

ast_arg *ast_arg_range(ast_parser *p, const ast_tok *lo, const ast_tok *hi, ast_loc loc)
{
    ast_arg *a;
    size_t n1, n2;
    char *text;
    if (!lo || !hi || !lo->text || !hi->text) return NULL;
    if (!(a = node(p, sizeof *a))) return NULL;
    n1 = strlen(lo->text);
    n2 = strlen(hi->text);
    if (!(text = node(p, n1 + n2 + 3))) return NULL;
    memcpy(text, lo->text, n1);
    memcpy(text + n1, "..", 2);
    memcpy(text + n1 + 2, hi->text, n2 + 1);
    a->kind = AST_RANGE;
    a->loc = loc;
    a->text = text;
    a->bad = lo->bad || hi->bad;
    /* num: 0 when both ends are whole numbers, -1 otherwise (semantic analysis rejects that range). */
    a->num = lo->is_int && hi->is_int ? 0 : -1;
    a->lo = lo->num > 1e9 ? 1000000000 : lo->num < -1e9 ? -1000000000 : (int)lo->num;
    a->hi = hi->num > 1e9 ? 1000000000 : hi->num < -1e9 ? -1000000000 : (int)hi->num;
    return a;
}

static ast_slist one(ast_stmt *s)
{
    ast_slist l = {s, s};
    return l;
}

static int count_args(const ast_arg *a)
{
    int n = 0;
    for (; a; a = a->next) n++;
    return n;
}

ast_slist ast_stmt_end(ast_parser *p, ast_stmt *words, ast_block *block)
{
    ast_slist out = {NULL, NULL};
    ast_stmt *cur = words;
    ast_arg *prev = NULL, *a;
    ast_loc prev_loc;

    if (!words) return out;
    out = one(words);
    prev_loc = words->loc;
    a = words->args;
    /* Statements are line-oriented: a keyword on a later line than the statement it would continue means a
     * forgotten ';'. Split there, so the rest of the file is still read as intended. */
    while (a) {
        if (a->kind == AST_IDENT && a->loc.line > prev_loc.end_line) {
            ast_stmt *s = node(p, sizeof *s);
            char q[48];
            if (!s) return out;
            ast_diag_add(p->diags, KVQ_DIAG_ERROR, p->src, prev_loc.end_line, prev_loc.end_col,
                         "expected ';' after '%s'", ast_diag_quote(q, sizeof q, prev ? prev->text : cur->name, 32));
            s->name = a->text;
            s->loc = a->loc;
            s->args = a->next;
            s->args_tail = a->next ? cur->args_tail : NULL;
            s->n_args = count_args(s->args);
            if (prev) {
                prev->next = NULL;
                cur->args_tail = prev;
            } else {
                cur->args = cur->args_tail = NULL;
            }
            cur->n_args = count_args(cur->args);
            cur->next = s;
            out.tail = cur = s;
            prev = NULL;
            prev_loc = s->loc;
            a = s->args;
            continue;
        }
        prev = a;
        prev_loc = a->loc;
        a = a->next;
    }
    if (block) out.tail->block = block;
    return out;
}

ast_slist ast_slist_add(ast_slist list, ast_slist more)
{
    if (!more.head) return list;
    if (!list.head) return more;
    list.tail->next = more.head;
    list.tail = more.tail;
    return list;
}

ast_block *ast_block_new(ast_parser *p, ast_loc open, ast_slist body)
{
    ast_block *b = node(p, sizeof *b);
    if (!b) return NULL;
    b->open = open;
    b->body = body.head;
    return b;
}

/* ---------------------------------------------------------------------------------------------------------- */
/* Syntax errors */

static const char *expected_name(int t)
{
    switch (t) {
    case AST_T_END: return "end of file";
    case AST_T_IDENT: return "a name";
    case AST_T_INT: return "a number";
    case AST_T_PERCENT: return "a percentage";
    case AST_T_STRING: return "a string";
    case AST_T_SCHEME: return "'scheme'";
    case AST_T_INCLUDE: return "'include'";
    case AST_T_LBRACE: return "'{'";
    case AST_T_RBRACE: return "'}'";
    case AST_T_SEMI: return "';'";
    case AST_T_COLON: return "':'";
    case AST_T_DOTDOT: return "'..'";
    default: return "something else";
    }
}

static int is_value(int t) { return t == AST_T_IDENT || t == AST_T_INT || t == AST_T_PERCENT || t == AST_T_STRING; }

void ast_syntax_error(ast_parser *p, ast_loc at, int unexpected, const char *unexpected_text, const int *expected,
                      int n_expected)
{
    char q[48], what[96], list[256];
    int has[AST_T_COUNT] = {0}, n_values = 0;
    size_t len = 0;

    if (p->stop || p->nomem) return;
    for (int i = 0; i < n_expected; i++)
        if (expected[i] >= 0 && expected[i] < AST_T_COUNT) has[expected[i]] = 1;
    /* "expected end of file, 'scheme' or 'include'" reads oddly: the end of the file is always fine there. */
    if (n_expected > 1) has[AST_T_END] = 0;
    for (int t = 0; t < AST_T_COUNT; t++) n_values += has[t] && is_value(t);

    if (unexpected == AST_T_END && has[AST_T_RBRACE] && p->depth > 0) {
        int d = p->depth <= 64 ? p->depth - 1 : 63;
        ast_diag_add(p->diags, KVQ_DIAG_ERROR, p->src, at.line, at.col,
                     "expected '}' before end of file, to close the '{' at line %d", p->open_brace[d].line);
        return;
    }
    if (has[AST_T_SEMI] && (unexpected == AST_T_RBRACE || unexpected == AST_T_END || unexpected == AST_T_SCHEME ||
                            unexpected == AST_T_INCLUDE)) {
        if (p->prev_bad) return; /* an unterminated string swallowed the ';' and was reported */
        ast_diag_add(p->diags, KVQ_DIAG_ERROR, p->src, p->prev_loc.end_line, p->prev_loc.end_col,
                     "expected ';' after '%s'", ast_diag_quote(q, sizeof q, p->prev_text, 32));
        return;
    }

    ast_diag_quote(q, sizeof q, unexpected_text ? unexpected_text : "", 32);
    switch (unexpected) {
    case AST_T_END: snprintf(what, sizeof what, "end of file"); break;
    case AST_T_INT: snprintf(what, sizeof what, "number '%s'", q); break;
    case AST_T_PERCENT: snprintf(what, sizeof what, "percentage '%s'", q); break;
    case AST_T_STRING: snprintf(what, sizeof what, "string \"%s\"", q); break;
    default: snprintf(what, sizeof what, "'%s'", q); break;
    }

    /* "a name, a number, a percentage or a string" says less than "a value". */
    int items[AST_T_COUNT + 1], n_items = 0, value_listed = 0;
    for (int t = 0; t < AST_T_COUNT; t++) {
        if (!has[t]) continue;
        if (is_value(t) && n_values > 1) {
            if (!value_listed) items[n_items++] = -1;
            value_listed = 1;
            continue;
        }
        items[n_items++] = t;
    }
    list[0] = '\0';
    for (int i = 0; i < n_items; i++) {
        /* Where a block's '}' could come, a name starts a statement. */
        const char *name = items[i] < 0                                   ? "a value"
                           : items[i] == AST_T_IDENT && has[AST_T_RBRACE] ? "a statement"
                                                                          : expected_name(items[i]);
        const char *sep = i == 0 ? "" : i == n_items - 1 ? " or " : ", ";
        int k = snprintf(list + len, sizeof list - len, "%s%s", sep, name);
        if (k < 0 || (size_t)k >= sizeof list - len) break;
        len += (size_t)k;
    }
    if (n_items)
        ast_diag_add(p->diags, KVQ_DIAG_ERROR, p->src, at.line, at.col, "unexpected %s; expected %s", what, list);
    else
        ast_diag_add(p->diags, KVQ_DIAG_ERROR, p->src, at.line, at.col, "unexpected %s", what);
}
