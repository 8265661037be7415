#!/usr/bin/env python3
"""doc_decls.py — the house rule that every public function and every type
is documented where it is declared (STYLE.md), checked on the headers.

usage: doc_decls.py SRCDIR

Scans every .h and .cuh of SRCDIR outside tests/ and subprojects/ (in
the CUDA kernels' .cuh headers the device functions, whose return types
carry __device__, are not matched: the host-side declarations are).  A
function declaration (a line at column 0 naming `name(`, or `name(` below
a line holding only its return type, as static inline definitions are
written) and a struct, union or enum definition (`struct name {`) need a
comment before them: the
comment's end (`*/`, on a line that the comment starts or continues: a
trailing comment documents its own line only) or a `//` line right above, or above a run of
declarations and continuation lines that the same comment introduces
(`create` beside `free`; a struct's size macro).  A blank line, a
preprocessor line other than #define or a closing brace between the comment
and the declaration breaks the run.  Prints each
undocumented declaration as FILE:LINE: TEXT and exits 1 when there is one.
"""
import os
import re
import sys

FUNC = re.compile(r'^(?:static inline |extern |DSV4_API )?[A-Za-z_][\w \*]*\b[a-z_]\w*\s*\(')
NAME = re.compile(r'^[a-z_]\w*\s*\(')
RTYPE = re.compile(r'^(?:static |inline |extern |const |unsigned |struct |enum )*[A-Za-z_]\w*[ \*]*$')
TYPE = re.compile(r'^(?:typedef\s+)?(?:struct|union|enum)\s+\w+\s*\{')


def documented(lines, i):
    j = i - 1
    while j >= 0:
        p = lines[j].rstrip()
        q = p.lstrip()
        if q.startswith('//') or (p.endswith('*/') and q.startswith(('/*', '*'))):
            return True
        if p.endswith('*/'):
            return False    # a trailing comment documents its own line
        if p == '' or (p.startswith('#') and not p.startswith('#define')) or \
                p.startswith('}') or p.endswith('{'):
            return False
        j -= 1
    return False


def check(path):
    with open(path, encoding='utf-8') as fp:
        return check_lines(fp.read().split('\n'))


# The checker's own cases, run before each scan: (header text, the lines
# it must report).  A checker that passed everything would pass the tree.
SELF = [
    ("/* Make one. */\nint dsv4_make(void);\n", []),
    ("/* Make and free one. */\nint dsv4_make(void);\nvoid dsv4_free(int);\n", []),
    ("int dsv4_make(void);\n", [1]),
    ("/* Make one. */\n\nint dsv4_make(void);\n", [3]),
    ("int dsv4_x; /* a trailing comment */\nint dsv4_make(void);\n", [2]),
    ("/* A. */\nstruct dsv4_a {\n    int dsv4_member(void);\n};\nstruct dsv4_b {\n};\n", [5]),
    ("/* Inline. */\nstatic inline int\ndsv4_f(void)\n{\n    return 0;\n}\n"
     "static inline int\ndsv4_g(void)\n{\n    return 0;\n}\n", [8]),
    ("// Make one.\nint dsv4_make(void);\n", []),
]


def self_check():
    """Returns the cases the checker misjudges, as text."""
    wrong = []
    for text, want in SELF:
        got = [ln for ln, _ in check_lines(text.split('\n'))]
        if got != want:
            wrong.append('%r: reported %s, want %s' % (text, got, want))
    return wrong


def check_lines(lines):
    bad = []
    in_body = 0
    in_cpp = False
    for i, line in enumerate(lines):
        # the extern "C" { ... } of #ifdef __cplusplus blocks is no body
        if line.startswith('#ifdef __cplusplus'):
            in_cpp = True
        elif in_cpp and line.startswith('#endif'):
            in_cpp = False
        if in_cpp:
            continue
        if in_body == 0 and (TYPE.match(line) or
                             (FUNC.match(line) and not line.startswith('typedef'))):
            if not documented(lines, i):
                bad.append((i + 1, line.strip()))
        elif in_body == 0 and NAME.match(line) and i > 0 and RTYPE.match(lines[i - 1]):
            # the return type on the line above (static inline definitions)
            if not documented(lines, i - 1):
                bad.append((i + 1, line.strip()))
        # skip what is inside a definition's braces (inline function bodies,
        # struct members): only declarations outside them are checked
        in_body = max(in_body + line.count('{') - line.count('}'), 0)
    return bad


def main():
    if len(sys.argv) != 2:
        print(__doc__.split('\n\n')[1], file=sys.stderr)
        return 2
    src = sys.argv[1]
    wrong = self_check()
    for w in wrong:
        print('doc_decls self-check: %s' % w)
    if wrong:
        return 1
    n = 0
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        top = rel.split(os.sep)[0]
        if top in ('tests', 'subprojects', '.git', '.carry') or top.startswith('build'):
            dirs[:] = []
            continue
        for f in sorted(files):
            if not f.endswith(('.h', '.cuh')):
                continue
            path = os.path.join(root, f)
            for ln, text in check(path):
                print('%s:%d: %s' % (os.path.relpath(path, src), ln, text[:100]))
                n += 1
    print('%d undocumented declaration(s)' % n)
    return 1 if n else 0


if __name__ == '__main__':
    sys.exit(main())
