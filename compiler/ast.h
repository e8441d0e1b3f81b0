/* The syntax tree of a .kvq file, built by the grammar (grammar/kvq.y) and read by semantic analysis.
 *
 * The grammar is deliberately generic below the scheme level: a statement is a keyword, a few arguments and an
 * optional block. Which keywords exist, where, and what their arguments mean is semantic analysis's business
 * (compiler/sema.c), so a misspelt keyword gets a precise message instead of a parser error, and error recovery
 * stays simple. Everything lives in an arena freed with the parse. */
#ifndef KVQ_AST_H
#define KVQ_AST_H

#include <stddef.h>

#include "diag.h"

/* ---- arena: bump allocation in chunks; one free releases everything ---- */
typedef struct ast_chunk ast_chunk;
typedef struct ast_arena {
    ast_chunk *head;
} ast_arena;

void *ast_alloc(ast_arena *a, size_t n);                          /* zeroed; NULL when out of memory */
char *ast_strndup(ast_arena *a, const char *s, size_t n);         /* NUL-terminated copy of n bytes */
void ast_arena_free(ast_arena *a);

/* ---- nodes ---- */
typedef struct ast_loc {
    int line, col;     /* 1-based, col in bytes */
    int end_line, end_col; /* just after the last byte */
} ast_loc;

typedef enum {
    AST_IDENT,   /* channel, kivi, smallest ... */
    AST_INT,     /* 128 */
    AST_REAL,    /* 0.2 */
    AST_PERCENT, /* 5% or 2.5%: num holds 5 or 2.5 */
    AST_RANGE,   /* 0..1 */
    AST_STRING   /* "file.kvq": text holds the contents without quotes */
} ast_arg_kind;

typedef struct ast_arg {
    ast_arg_kind kind;
    ast_loc loc;
    const char *text;  /* as written (capped for very long tokens), for messages */
    double num;        /* AST_INT, AST_REAL, AST_PERCENT */
    int lo, hi;        /* AST_RANGE */
    int bad;           /* already diagnosed by the lexer: semantic analysis skips it quietly */
    struct ast_arg *next;
} ast_arg;

typedef struct ast_block ast_block;

typedef struct ast_stmt {
    const char *name;
    ast_loc loc;
    ast_arg *args, *args_tail;
    int n_args;
    ast_block *block;  /* NULL: a simple statement ending in ';' */
    struct ast_stmt *next;
} ast_stmt;

struct ast_block {
    ast_loc open;      /* the '{' */
    ast_stmt *body;
};

typedef struct ast_slist {
    ast_stmt *head, *tail;
} ast_slist;

typedef enum { AST_ITEM_SCHEME, AST_ITEM_INCLUDE } ast_item_kind;

typedef struct ast_item {
    ast_item_kind kind;
    ast_loc loc;             /* the 'scheme' or 'include' keyword */
    const char *name;        /* scheme name, or the include path */
    ast_loc name_loc;
    const char *parent;      /* NULL when the scheme does not inherit */
    ast_loc parent_loc;
    ast_block *block;        /* scheme body */
    struct ast_item *next;
} ast_item;

typedef struct ast_ilist {
    ast_item *head, *tail;
} ast_ilist;

/* A token's value as the lexer hands it to the grammar. */
typedef struct ast_tok {
    const char *text;   /* arena copy (identifiers and strings in full up to their cap, numbers as written) */
    double num;
    int is_int;
    int bad;            /* the lexer already reported it (a number too large, an unterminated string) */
} ast_tok;

/* ---- the parse of one file ---- */
typedef struct ast_parser {
    ast_arena *arena;
    diag_list *diags;
    const diag_src *src;    /* the file being parsed: its name and text, for diagnostics */
    ast_ilist items;        /* the result */
    int nomem;              /* an allocation failed: the parse stops and reports KVQ_ERR_NOMEM */
    int stop;               /* a fatal lexical error (nesting too deep, too many errors): quietly stop */
    int max_schemes;        /* > 0: stop after this many scheme items (spec.c: one past the spec's limit, so a
                               huge file of schemes costs memory for that many, not for all of them) */
    int n_schemes;
    /* lexer state used by the syntax-error messages */
    char prev_text[48];     /* the token before the last one read (the lookahead when an error is found) */
    ast_loc prev_loc;
    char cur_text[48];      /* the last token read */
    ast_loc cur_loc;
    int prev_bad, cur_bad;  /* those tokens were already diagnosed: no "expected ';' after" cascade */
    int depth;              /* open braces */
    ast_loc open_brace[64]; /* where the innermost open blocks began (deeper ones are not recorded) */
} ast_parser;

/* Parses src into p->items. Returns 0 on success (there may still be diagnostics), -1 when out of memory. */
int ast_parse(ast_parser *p);

/* Grammar actions. All of them accept NULL children (after an out-of-memory, or error recovery) and return
 * NULL when out of memory, setting p->nomem. */
ast_item *ast_scheme(ast_parser *p, ast_loc kw, const ast_tok *name, ast_loc name_loc, const ast_tok *parent,
                     ast_loc parent_loc, ast_block *block);
ast_item *ast_include(ast_parser *p, ast_loc kw, const ast_tok *path, ast_loc path_loc);
void ast_items_add(ast_parser *p, ast_item *it);
ast_stmt *ast_words_start(ast_parser *p, const ast_tok *word, ast_loc loc);
ast_stmt *ast_words_add(ast_parser *p, ast_stmt *words, ast_arg *arg);
ast_arg *ast_arg_ident(ast_parser *p, const ast_tok *t, ast_loc loc);
ast_arg *ast_arg_number(ast_parser *p, const ast_tok *t, ast_loc loc);
ast_arg *ast_arg_percent(ast_parser *p, const ast_tok *t, ast_loc loc);
ast_arg *ast_arg_string(ast_parser *p, const ast_tok *t, ast_loc loc);
ast_arg *ast_arg_range(ast_parser *p, const ast_tok *lo, const ast_tok *hi, ast_loc loc);
/* Ends a statement (block NULL: it ended with ';'). A statement that runs past the end of its line without ';'
 * is split there with a diagnostic, so the returned list may hold several statements. */
ast_slist ast_stmt_end(ast_parser *p, ast_stmt *words, ast_block *block);
ast_slist ast_slist_add(ast_slist list, ast_slist more);
ast_block *ast_block_new(ast_parser *p, ast_loc open, ast_slist body);

/* Syntax errors reported by the parser, described in neutral terms so the message text lives here. */
enum {
    AST_T_END, AST_T_IDENT, AST_T_INT, AST_T_PERCENT, AST_T_STRING, AST_T_SCHEME, AST_T_INCLUDE,
    AST_T_LBRACE, AST_T_RBRACE, AST_T_SEMI, AST_T_COLON, AST_T_DOTDOT, AST_T_OTHER, AST_T_COUNT
};
void ast_syntax_error(ast_parser *p, ast_loc at, int unexpected, const char *unexpected_text,
                      const int *expected, int n_expected);

#endif
