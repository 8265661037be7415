/*
 * test_comm_ar_tune.c — the cudaipc all-reduce's kernel setting without a
 * GPU (kernels/comm.h, kernels/comm_id.c): DSV4_CUDA_AR specs parsed into
 * kernel and geometry (defaults, fields, refusals), the kernel AUTO picks
 * at its LL limit, and the blocks of a launch; in a build without CUDA,
 * set_tune refuses.
 */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "kernels/comm.h"

#define KIB ((size_t)1 << 10)

static void
test_parse_defaults(void **state)
{
    struct dsv4_comm_ar_tune t;
    const char *same[] = { NULL, "", "auto", "auto:", "auto:,,", "auto:256,8,32" };

    (void)state;
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++) {
        memset(&t, 0x55, sizeof(t));
        assert_int_equal(dsv4_comm_ar_tune_parse(&t, same[i]), DSV4_OK);
        assert_int_equal(t.algo, DSV4_COMM_AR_AUTO);
        assert_int_equal(t.ll_max, 256 * KIB);
        assert_int_equal(t.ll_block, 8 * KIB);
        assert_int_equal(t.push_block, 32 * KIB);
    }
}

static void
test_parse_fields(void **state)
{
    struct dsv4_comm_ar_tune t;

    (void)state;
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "v1"), DSV4_OK);
    assert_int_equal(t.algo, DSV4_COMM_AR_V1);
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "push:,,64"), DSV4_OK);
    assert_int_equal(t.algo, DSV4_COMM_AR_PUSH);
    assert_int_equal(t.ll_max, 256 * KIB);
    assert_int_equal(t.ll_block, 8 * KIB);
    assert_int_equal(t.push_block, 64 * KIB);
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "ll:512,16"), DSV4_OK);
    assert_int_equal(t.algo, DSV4_COMM_AR_LL);
    assert_int_equal(t.ll_max, 512 * KIB);
    assert_int_equal(t.ll_block, 16 * KIB);
    assert_int_equal(t.push_block, 32 * KIB);
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "auto:1048576"), DSV4_OK);
    assert_int_equal(t.ll_max, 1048576 * KIB);
}

static void
test_parse_refused(void **state)
{
    static const char *bad[] = { "fast", "autox", "AUTO", "ll:0", "ll:1048577", "ll:8,x",
                                 "push:1,2,3,4", "push:1,2,3,", "ll:-1", ":8", "ll;8",
                                 "ll:99999999999999999999" };
    struct dsv4_comm_ar_tune t;

    (void)state;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memset(&t, 0x55, sizeof(t));
        assert_int_equal(dsv4_comm_ar_tune_parse(&t, bad[i]), DSV4_ERR_CONFIG);
        /* defaults, not a half-parsed setting */
        assert_int_equal(t.algo, DSV4_COMM_AR_AUTO);
        assert_int_equal(t.ll_max, 256 * KIB);
        assert_non_null(strstr(dsv4_errmsg(), "DSV4_CUDA_AR"));
    }
}

static void
test_pick(void **state)
{
    struct dsv4_comm_ar_tune t;

    (void)state;
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "auto:128"), DSV4_OK);
    assert_int_equal(dsv4_comm_ar_pick(&t, 1), DSV4_COMM_AR_LL);
    assert_int_equal(dsv4_comm_ar_pick(&t, 32768), DSV4_COMM_AR_LL);     /* 128 KiB */
    assert_int_equal(dsv4_comm_ar_pick(&t, 32769), DSV4_COMM_AR_PUSH);
    assert_int_equal(dsv4_comm_ar_pick(&t, 458752), DSV4_COMM_AR_PUSH);
    /* a fixed kernel whatever n */
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "ll"), DSV4_OK);
    assert_int_equal(dsv4_comm_ar_pick(&t, 1 << 24), DSV4_COMM_AR_LL);
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "v1"), DSV4_OK);
    assert_int_equal(dsv4_comm_ar_pick(&t, 1), DSV4_COMM_AR_V1);
    assert_int_equal(dsv4_comm_ar_tune_parse(&t, "push"), DSV4_OK);
    assert_int_equal(dsv4_comm_ar_pick(&t, 1), DSV4_COMM_AR_PUSH);
}

static void
test_blocks(void **state)
{
    (void)state;
    assert_int_equal(dsv4_comm_ar_blocks(4, 8 * KIB), 1);
    assert_int_equal(dsv4_comm_ar_blocks(8 * KIB, 8 * KIB), 1);
    assert_int_equal(dsv4_comm_ar_blocks(8 * KIB + 4, 8 * KIB), 2);
    assert_int_equal(dsv4_comm_ar_blocks(128 * KIB, 8 * KIB), 16);
    assert_int_equal(dsv4_comm_ar_blocks(512 * KIB, 32 * KIB), 16);
    assert_int_equal(dsv4_comm_ar_blocks(2048 * KIB, 32 * KIB), DSV4_COMM_AR_MAX_BLOCKS);
    assert_int_equal(dsv4_comm_ar_blocks((size_t)1 << 30, 8 * KIB), DSV4_COMM_AR_MAX_BLOCKS);
    assert_int_equal(dsv4_comm_ar_blocks(0, 8 * KIB), 1);
}

#ifndef DSV4_HAVE_CUDA
static void
test_set_tune_nocuda(void **state)
{
    (void)state;
    assert_int_equal(dsv4_comm_cudaipc_set_tune(NULL, "ll"), DSV4_ERR_INVAL);
}
#endif

int
main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_defaults),
        cmocka_unit_test(test_parse_fields),
        cmocka_unit_test(test_parse_refused),
        cmocka_unit_test(test_pick),
        cmocka_unit_test(test_blocks),
#ifndef DSV4_HAVE_CUDA
        cmocka_unit_test(test_set_tune_nocuda),
#endif
    };

    return cmocka_run_group_tests(tests, NULL, NULL);
}
