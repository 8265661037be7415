/*
 * fuzz_proto.c — libFuzzer target for the protocol decoder of one
 * sub-protocol (FUZZ_SUB = 1 client, 2 rank, 3 admin; see tests/fuzz/run.sh).
 *
 * Input: the frames after the signature (command, body, raw frames...), each
 * as a 2-byte little-endian length followed by its bytes; a short last
 * frame takes what is left.  The target adds the empty delimiter and the
 * signature.  Whatever decodes must re-encode, and the re-encoding must
 * decode to an equal message; anything else aborts.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/proto.h"

#ifndef FUZZ_SUB
#define FUZZ_SUB DSV4_SUB_CLI
#endif

#define FUZZ_MAX_FRAMES (DSV4_PROTO_MAX_FRAMES + 4)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct dsv4_frame fr[FUZZ_MAX_FRAMES], fr2[DSV4_PROTO_MAX_FRAMES];
    struct dsv4_msg m, m2;
    struct dsv4_wire w;
    struct dsv4_perr pe;
    size_t n = 0, off = 0;

    fr[n++] = (struct dsv4_frame){ "", 0 };
    fr[n++] = (struct dsv4_frame){ dsv4_proto_sig(FUZZ_SUB), DSV4_PROTO_SIG_LEN };
    while (off < size && n < FUZZ_MAX_FRAMES) {
        size_t len = data[off];

        if (off + 1 < size)
            len |= (size_t)data[off + 1] << 8;
        off += 2;
        if (off > size)
            off = size;
        if (len > size - off)
            len = size - off;
        fr[n++] = (struct dsv4_frame){ data + off, len };
        off += len;
    }
    if (dsv4_msg_decode(&m, fr, n, &pe) != DSV4_OK) {
        if (pe.code < 400 || pe.code > 599 || pe.message[0] == '\0' || m.mem != NULL)
            abort();
        return 0;
    }
    if (dsv4_msg_encode(&m, &w, &pe) != DSV4_OK)
        abort(); /* decoded but cannot be sent back: encoder and decoder disagree */
    n = 0;
    fr2[n++] = (struct dsv4_frame){ "", 0 };
    fr2[n++] = (struct dsv4_frame){ w.sig, DSV4_PROTO_SIG_LEN };
    fr2[n++] = (struct dsv4_frame){ &w.cmd, 1 };
    fr2[n++] = (struct dsv4_frame){ w.body, w.body_len };
    for (uint32_t i = 0; i < w.n_raw; i++)
        fr2[n++] = w.raw[i];
    if (dsv4_msg_decode(&m2, fr2, n, &pe) != DSV4_OK || !dsv4_msg_equal(&m, &m2))
        abort();
    dsv4_msg_clear(&m2);
    dsv4_wire_clear(&w);
    dsv4_msg_clear(&m);
    return 0;
}
