/* Whether a translation unit built ahead of time (generated/<scheme>/kernels.cu, `kvqc build`) is the unit an
 * engine emits, so that the engine loads its cubin instead of compiling at run time. The units are compared as
 * code, with every comment counted as one space: a unit's comments name things that do not change the code (the
 * model's layer count, which the plan's classes already account for), and an engine of 28 layers must find the
 * cubin built for 32 (issue 18, defect 6). Strings and character literals are code: a comment marker inside one
 * is not a comment. */
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "cu_dev.h"
#include "read_file.h"
#include "rt_internal.h"

/* The next byte of code at *i (a comment yields one ' '), or -1 at the end; *lit tracks a string or character
 * literal: its quote (0 outside one), plus 256 right after a backslash in it. */
static int next_code(const char *s, size_t n, size_t *i, int *lit)
{
    if (*i >= n) return -1;
    char c = s[(*i)++];
    if (*lit & 256) /* the escaped byte: never ends the literal */
        *lit &= 255;
    else if (*lit) {
        if (c == '\\') *lit |= 256;
        else if (c == *lit || c == '\n') *lit = 0;
    } else if (c == '"' || c == '\'') {
        *lit = c;
    } else if (c == '/' && *i < n && s[*i] == '*') {
        size_t j = *i + 1;
        while (j + 1 < n && !(s[j] == '*' && s[j + 1] == '/')) j++;
        *i = j + 1 < n ? j + 2 : n; /* an unterminated comment runs to the end */
        return ' ';
    } else if (c == '/' && *i < n && s[*i] == '/') {
        while (*i < n && s[*i] != '\n') (*i)++; /* the newline stays code */
        return ' ';
    }
    return (unsigned char)c;
}

int cu_source_same_code(const char *a, size_t na, const char *b, size_t nb)
{
    size_t i = 0, j = 0;
    int la = 0, lb = 0;
    for (;;) {
        int x = next_code(a, na, &i, &la), y = next_code(b, nb, &j, &lb);
        if (x != y) return 0;
        if (x < 0) return 1;
    }
}

int cu_generated_matches(const char *src, const char *scheme)
{
    if (!scheme) return 0;
    char dir[4200], path[4400];
    kvq_generated_dir(scheme, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/kernels.cu", dir);
    size_t n = 0;
    char *text = kvq_read_file(path, &n);
    int same = text && cu_source_same_code(text, n, src, strlen(src));
    kvq_free(text);
    return same;
}

unsigned char *cu_generated_cubin(const char *src, const char *scheme, const char *arch, size_t *size)
{
    if (!cu_generated_matches(src, scheme)) return NULL;
    char dir[4200], path[4400];
    kvq_generated_dir(scheme, dir, sizeof dir);
    snprintf(path, sizeof path, "%s/%s.cubin", dir, arch);
    return (unsigned char *)kvq_read_file(path, size);
}
