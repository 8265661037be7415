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
comment's end (`*/`) or a `//` line right above, or above a run of
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
        if p.endswith('*/') or p.lstrip().startswith('//'):
            return True
        if p == '' or (p.startswith('#') and not p.startswith('#define')) or \
                p.startswith('}') or p.endswith('{'):
            return False
        j -= 1
    return False


def check(path):
    with open(path, encoding='utf-8') as fp:
        lines = fp.read().split('\n')
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
