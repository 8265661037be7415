/*
 * test_bench_stats.c — dsv4-bench arithmetic and options (tools/bench/):
 * percentiles on known inputs, summaries, the seeded RNG and length
 * distributions (reproducible, within bounds, right moments), the ITL
 * counting rule for multi-token events, and command-line refusals.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "bench.h"

#define EPS 1e-9

/* --- percentiles and summaries ----------------------------------------- */

static void
test_percentile_known(void **state)
{
    double v[100], small[] = { 1, 2, 3, 4 }, one[] = { 7 };

    (void)state;
    for (int i = 0; i < 100; i++)
        v[i] = i + 1;
    /* rank (n-1)p/100 with linear interpolation: 1..100 -> 1 + 0.99p */
    assert_true(fabs(bench_percentile(v, 100, 50) - 50.5) < EPS);
    assert_true(fabs(bench_percentile(v, 100, 90) - 90.1) < EPS);
    assert_true(fabs(bench_percentile(v, 100, 99) - 99.01) < EPS);
    assert_true(fabs(bench_percentile(v, 100, 0) - 1) < EPS);
    assert_true(fabs(bench_percentile(v, 100, 100) - 100) < EPS);
    assert_true(fabs(bench_percentile(small, 4, 50) - 2.5) < EPS);
    assert_true(fabs(bench_percentile(small, 4, 90) - 3.7) < EPS);
    assert_true(fabs(bench_percentile(small, 4, 99) - 3.97) < EPS);
    for (int p = 0; p <= 100; p += 10)
        assert_true(bench_percentile(one, 1, p) == 7);
}

static void
test_summarize(void **state)
{
    struct bench_samples s = { 0 };
    struct bench_summary sm;
    struct bench_rng r;

    (void)state;
    bench_summarize(&s, 1e3, &sm);
    assert_int_equal(sm.n, 0);
    assert_true(sm.p50 == 0 && sm.mean == 0 && sm.max == 0);

    /* 1..1000 in a shuffled order; summarize sorts. */
    for (int i = 1; i <= 1000; i++)
        assert_int_equal(bench_samples_add(&s, i), 0);
    bench_rng_seed(&r, 3, 0);
    for (size_t i = s.n - 1; i > 0; i--) {
        size_t j = bench_rng_next(&r) % (i + 1);
        double t = s.v[i];

        s.v[i] = s.v[j];
        s.v[j] = t;
    }
    bench_summarize(&s, 2.0, &sm);
    assert_int_equal(sm.n, 1000);
    assert_true(fabs(sm.mean - 1001.0) < EPS);       /* 2 * 500.5 */
    assert_true(fabs(sm.min - 2.0) < EPS);
    assert_true(fabs(sm.max - 2000.0) < EPS);
    assert_true(fabs(sm.p50 - 2 * 500.5) < EPS);
    assert_true(fabs(sm.p90 - 2 * 900.1) < EPS);
    assert_true(fabs(sm.p99 - 2 * 990.01) < EPS);
    bench_samples_free(&s);
    assert_null(s.v);
}

static void
test_merge(void **state)
{
    struct bench_samples a = { 0 }, b = { 0 };

    (void)state;
    for (int i = 0; i < 300; i++)
        bench_samples_add(&a, i);
    for (int i = 0; i < 5; i++)
        bench_samples_add(&b, -i);
    assert_int_equal(bench_samples_merge(&b, &a), 0);
    assert_int_equal(b.n, 305);
    assert_true(b.v[4] == -4 && b.v[5] == 0 && b.v[304] == 299);
    bench_samples_free(&a);
    bench_samples_free(&b);
}

/* --- random numbers and distributions ------------------------------------ */

static void
test_rng_streams(void **state)
{
    struct bench_rng a, b, c, d;
    int same_bd = 1, same_cd = 1;

    (void)state;
    bench_rng_seed(&a, 42, 7);
    bench_rng_seed(&b, 42, 7);
    bench_rng_seed(&c, 42, 8);
    bench_rng_seed(&d, 43, 7);
    for (int i = 0; i < 100; i++) {
        uint64_t x = bench_rng_next(&a), y = bench_rng_next(&b);
        uint64_t z = bench_rng_next(&c), w = bench_rng_next(&d);

        assert_true(x == y);
        same_bd &= y == w;
        same_cd &= z == w;
        (void)z;
    }
    assert_false(same_bd);
    assert_false(same_cd);
    bench_rng_seed(&a, 1, 0);
    for (int i = 0; i < 10000; i++) {
        double u = bench_rng_uniform(&a);

        assert_true(u >= 0 && u < 1);
    }
}

static void
parse_ok(const char *spec, int kind, double a, double b)
{
    struct bench_dist d, e;
    char err[256], buf[128];

    if (bench_dist_parse(&d, spec, err, sizeof(err)) != 0)
        fail_msg("'%s' refused: %s", spec, err);
    assert_int_equal(d.kind, kind);
    assert_true(d.a == a && d.b == b);
    bench_dist_format(&d, buf, sizeof(buf));
    assert_int_equal(bench_dist_parse(&e, buf, err, sizeof(err)), 0);
    assert_true(e.kind == d.kind && e.a == d.a && e.b == d.b);
}

static void
test_dist_parse(void **state)
{
    static const char *const bad[] = {
        "", "0", "-3", "abc", "12x", "1.5", "2000000", "uniform:5:3", "uniform:0:3",
        "uniform:1.5:3", "uniform:1:2:3", "uniform::4", "uniform:4", "normal:10",
        "normal:10:-1", "normal:0:1", "lognormal:nan:1", "lognormal:10:inf", "gamma:1:2",
        "uniform:1:2000000", ":",
    };
    struct bench_dist d;
    char err[256];

    (void)state;
    parse_ok("512", BENCH_DIST_FIXED, 512, 512);
    parse_ok("1", BENCH_DIST_FIXED, 1, 1);
    parse_ok("uniform:256:1024", BENCH_DIST_UNIFORM, 256, 1024);
    parse_ok("uniform:7:7", BENCH_DIST_UNIFORM, 7, 7);
    parse_ok("normal:1024:128", BENCH_DIST_NORMAL, 1024, 128);
    parse_ok("normal:100.5:0", BENCH_DIST_NORMAL, 100.5, 0);
    parse_ok("lognormal:1024:512", BENCH_DIST_LOGNORMAL, 1024, 512);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = '\0';
        if (bench_dist_parse(&d, bad[i], err, sizeof(err)) == 0)
            fail_msg("'%s' accepted", bad[i]);
        assert_true(err[0] != '\0');
    }
}

/* Draw n lengths of spec with seed; return mean and sd, check bounds. */
static void
moments(const char *spec, uint64_t seed, int n, uint32_t lo, uint32_t hi, double *mean,
    double *sd, uint32_t *seen_lo, uint32_t *seen_hi)
{
    struct bench_dist d;
    double s = 0, s2 = 0;
    char err[256];

    assert_int_equal(bench_dist_parse(&d, spec, err, sizeof(err)), 0);
    *seen_lo = UINT32_MAX;
    *seen_hi = 0;
    for (int i = 0; i < n; i++) {
        struct bench_rng r;
        uint32_t x;

        bench_rng_seed(&r, seed, (uint64_t)i);  /* one stream per request, as bench_run */
        x = bench_dist_draw(&d, &r);
        assert_true(x >= lo && x <= hi);
        s += x;
        s2 += (double)x * x;
        if (x < *seen_lo)
            *seen_lo = x;
        if (x > *seen_hi)
            *seen_hi = x;
    }
    *mean = s / n;
    *sd = sqrt(s2 / n - *mean * *mean);
}

static void
test_dist_draws(void **state)
{
    double mean, sd;
    uint32_t lo, hi;

    (void)state;
    moments("300", 1, 100, 300, 300, &mean, &sd, &lo, &hi);
    assert_true(mean == 300 && sd == 0);
    /* uniform 10..20: every value, both ends, mean 15, sd sqrt((11^2-1)/12) */
    moments("uniform:10:20", 2, 20000, 10, 20, &mean, &sd, &lo, &hi);
    assert_int_equal(lo, 10);
    assert_int_equal(hi, 20);
    assert_true(fabs(mean - 15) < 0.1);
    assert_true(fabs(sd - sqrt(10.0)) < 0.1);
    moments("normal:1000:100", 3, 20000, 1, BENCH_MAX_LEN, &mean, &sd, &lo, &hi);
    assert_true(fabs(mean - 1000) < 5);
    assert_true(fabs(sd - 100) < 5);
    moments("lognormal:1000:500", 4, 40000, 1, BENCH_MAX_LEN, &mean, &sd, &lo, &hi);
    assert_true(fabs(mean - 1000) < 20);
    assert_true(fabs(sd - 500) < 25);
    /* clamped at 1: a normal mostly below zero never yields 0 */
    moments("normal:1:50", 5, 5000, 1, BENCH_MAX_LEN, &mean, &sd, &lo, &hi);
    assert_int_equal(lo, 1);
}

static void
test_dist_reproducible(void **state)
{
    struct bench_dist d;
    char err[256];
    int differ = 0;

    (void)state;
    assert_int_equal(bench_dist_parse(&d, "lognormal:512:256", err, sizeof(err)), 0);
    for (uint64_t i = 0; i < 200; i++) {
        struct bench_rng a, b, c;
        uint32_t x, y, z;

        bench_rng_seed(&a, 9, i);
        bench_rng_seed(&b, 9, i);
        bench_rng_seed(&c, 10, i);
        x = bench_dist_draw(&d, &a);
        y = bench_dist_draw(&d, &b);
        z = bench_dist_draw(&d, &c);
        assert_int_equal(x, y);
        differ += x != z;
    }
    assert_true(differ > 150);
}

/* --- stream timing -------------------------------------------------------- */

static void
test_stream_itl(void **state)
{
    struct bench_samples itl = { 0 };
    struct bench_stream st;
    double sum = 0;

    (void)state;
    bench_stream_begin(&st, 10.0);
    assert_int_equal(bench_stream_tokens(&st, 10.5, 0, &itl), 0); /* empty: ignored */
    assert_int_equal(st.n_tokens, 0);
    /* first event: 2 tokens -> TTFT 1.0, no ITL sample */
    assert_int_equal(bench_stream_tokens(&st, 11.0, 2, &itl), 0);
    assert_true(st.t_first == 11.0);
    assert_int_equal(itl.n, 0);
    /* 1 token after 0.25 s -> one sample 0.25 */
    bench_stream_tokens(&st, 11.25, 1, &itl);
    /* 4 tokens after 1.0 s -> four samples of 0.25 */
    bench_stream_tokens(&st, 12.25, 4, &itl);
    /* 1 token after 0.5 s */
    bench_stream_tokens(&st, 12.75, 1, &itl);
    assert_int_equal(st.n_tokens, 8);
    assert_int_equal(itl.n, 6);
    for (size_t i = 0; i < 5; i++)
        assert_true(fabs(itl.v[i] - 0.25) < EPS);
    assert_true(fabs(itl.v[5] - 0.5) < EPS);
    for (size_t i = 0; i < itl.n; i++)
        sum += itl.v[i];
    assert_true(fabs(sum - (st.t_last - st.t_first)) < EPS);
    /* without a sample array the timing is still kept */
    bench_stream_tokens(&st, 13.0, 2, NULL);
    assert_int_equal(st.n_tokens, 10);
    assert_int_equal(itl.n, 6);
    bench_samples_free(&itl);
}

/* --- options -------------------------------------------------------------- */

/* Parse a NULL-terminated argument list into *o; returns the parser's value. */
static int
parse(struct bench_opts *o, char *err, ...)
{
    char *argv[64];
    int argc = 0;
    va_list ap;

    argv[argc++] = (char *)(uintptr_t)"dsv4-bench";
    va_start(ap, err);
    while ((argv[argc] = va_arg(ap, char *)) != NULL) {
        argc++;
        assert_true(argc < 64);
    }
    va_end(ap);
    bench_opts_init(o);
    err[0] = '\0';
    return bench_opts_parse(o, argc, argv, err, 256);
}

#define A(s) ((char *)(uintptr_t)(s))

static void
test_opts_ok(void **state)
{
    struct bench_opts o;
    char err[256];

    (void)state;
    assert_int_equal(parse(&o, err, NULL), 0);
    assert_int_equal(o.n_levels, 1);
    assert_int_equal(o.concurrency[0], 1);
    assert_int_equal(o.warmup, -1);
    assert_string_equal(o.json_path, "-");
    assert_int_equal(parse(&o, err, A("-e"), A("tcp://h:5555"), A("-c"), A("1,2,4,8,16,32,64"),
        A("-p"), A("normal:1024:128"), A("-l"), A("512"), A("-n"), A("100"), A("-w"), A("0"),
        A("-s"), A("99"), A("-t"), A("0"), A("--top-p"), A("0.9"), A("--top-k"), A("40"),
        A("--token-range"), A("2:1024"), A("--no-stream"), A("--timeout"), A("5000"),
        A("-j"), A("r.json"), A("-P"), A("r.png"), A("-L"), A("x"), A("-q"), NULL), 0);
    assert_string_equal(o.endpoint, "tcp://h:5555");
    assert_int_equal(o.n_levels, 7);
    assert_int_equal(o.concurrency[6], 64);
    assert_int_equal(o.prompt.kind, BENCH_DIST_NORMAL);
    assert_true(o.output.kind == BENCH_DIST_FIXED && o.output.a == 512);
    assert_int_equal(o.requests, 100);
    assert_int_equal(o.warmup, 0);
    assert_int_equal(o.seed, 99);
    assert_true(o.temperature == 0 && fabsf(o.top_p - 0.9f) < 1e-6f && o.top_k == 40);
    assert_true(o.id_lo == 2 && o.id_hi == 1024);
    assert_int_equal(o.stream, 0);
    assert_int_equal(o.timeout_ms, 5000);
    assert_string_equal(o.plot_path, "r.png");
    assert_int_equal(o.quiet, 1);
    assert_int_equal(parse(&o, err, A("-d"), A("2.5"), NULL), 0);
    assert_true(o.duration_s == 2.5);
}

static void
test_opts_errors(void **state)
{
    static const char *const bad[][3] = {
        { "-c", "0", NULL }, { "-c", "65", NULL }, { "-c", "1,,2", NULL }, { "-c", "1,", NULL },
        { "-c", "x", NULL }, { "-c", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17", NULL },
        { "-n", "0", NULL }, { "-d", "0", NULL }, { "-d", "-1", NULL }, { "-t", "11", NULL },
        { "--top-p", "0", NULL }, { "--top-p", "1e-50", NULL }, { "--top-p", "1.5", NULL },
        { "--token-range", "5:5", NULL }, { "--token-range", "5", NULL }, { "--token-range", "-1:5", NULL }, { "-w", "-2", NULL },
        { "-p", "normal:3", NULL }, { "-l", "0", NULL }, { "--bogus", NULL, NULL },
        { "-c", NULL, NULL }, { "positional", NULL, NULL }, { "--timeout", "1e3", NULL },
        { "-j", "", NULL }, { "--plot", "", NULL },
    };
    struct bench_opts o;
    char err[256];

    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = parse(&o, err, A(bad[i][0]), A(bad[i][1]), NULL);

        if (rc != -1)
            fail_msg("%s %s: accepted (rc %d)", bad[i][0], bad[i][1] ? bad[i][1] : "", rc);
        assert_true(err[0] != '\0');
    }
    assert_int_equal(parse(&o, err, A("-n"), A("5"), A("-d"), A("3"), NULL), -1);
    assert_non_null(strstr(err, "exclude"));
    assert_int_equal(parse(&o, err, A("-j"), A("a.png"), A("-P"), A("a.png"), NULL), -1);
}

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_percentile_known),
        cmocka_unit_test(test_summarize),
        cmocka_unit_test(test_merge),
        cmocka_unit_test(test_rng_streams),
        cmocka_unit_test(test_dist_parse),
        cmocka_unit_test(test_dist_draws),
        cmocka_unit_test(test_dist_reproducible),
        cmocka_unit_test(test_stream_itl),
        cmocka_unit_test(test_opts_ok),
        cmocka_unit_test(test_opts_errors),
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
