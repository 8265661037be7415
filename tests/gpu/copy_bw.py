#!/usr/bin/env python3
"""copy_bw.py — the device copy bandwidth of GPU 0 as DESIGN.md §7 measures
it (a device-to-device copy of a large buffer; bytes read + bytes written
over the time), for tests/gpu/targets.sh's BW on a card other than the
H200 whose 4.3 TB/s DESIGN.md §7 gives.

  copy_bw.py [GIB]      (default 4 GiB a buffer)

Prints "copy_bw: NAME X.XX TB/s (best of 20 copies of N GiB)" and the bare
figure on the last line.  Needs torch with CUDA (the GPU machine's python);
exit 77 without it.
"""
import sys

try:
    import torch
except ImportError:
    print("copy_bw: no torch: skipped")
    sys.exit(77)


def main():
    if not torch.cuda.is_available():
        print("copy_bw: no CUDA device: skipped")
        return 77
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    for _ in range(3):              # warm-up
        dst.copy_(src)
    torch.cuda.synchronize()
    best = None
    for _ in range(20):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        dst.copy_(src)
        t1.record()
        torch.cuda.synchronize()
        ms = t0.elapsed_time(t1)
        best = ms if best is None or ms < best else best
    tbs = 2 * n / (best / 1e3) / 1e12
    print("copy_bw: %s %.2f TB/s (best of 20 copies of %g GiB)" %
          (torch.cuda.get_device_name(0), tbs, gib))
    print("%.2f" % tbs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
