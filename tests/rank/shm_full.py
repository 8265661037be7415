#!/usr/bin/env python3
"""shm_full.py — a prefill rank whose warm-up export finds /dev/shm too small.

The decode-state region of the shm transport is sized for max_seq whatever
the rows of a call, so where /dev/shm cannot hold it smaller calls free none
of its room: the rank must stop at once with that reason (exit 1, "no room
in /dev/shm ... lower max_seq, or give /dev/shm more room"), not halve its
rows per call down to 1 and blame the GPU.

The rank runs in a mount namespace of its own with a 64 KiB tmpfs on
/dev/shm (unshare -m); where that is not allowed (no CAP_SYS_ADMIN) the test
is skipped (exit 77).

usage: shm_full.py BUILD_DIR
"""
import os
import subprocess
import sys
import tempfile


def main():
    build = sys.argv[1]
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        print("shm_full: SKIP (no unshare -m / tmpfs mount here)")
        return 77
    with tempfile.TemporaryDirectory(prefix="dsv4-shmfull-") as d:
        model = os.path.join(d, "m")
        subprocess.run([os.path.join(build, "tools/mkmodel/dsv4-mkmodel"), "--preset", "tiny",
                        "--out", model], check=True, stdout=subprocess.DEVNULL)
        rank = [os.path.join(build, "daemons/rank/dsv4-prefill"), "-v", "--rank", "0",
                "--checkpoint", model, "--sched", "ipc://%s/sched.sock" % d, "--threads", "1",
                "--max-seq", "256", "--slots", "1"]
        # 64 KiB: a 256-token region of the tiny model is about 360 KiB
        cmd = "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec " + " ".join(rank)
        try:
            r = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True,
                               text=True, timeout=120)
        except subprocess.TimeoutExpired:
            print("shm_full: FAIL: the rank did not stop within 120 s")
            return 1
        err = r.stderr
        ok = True
        if r.returncode != 1:
            print("shm_full: FAIL: exit %d, expected 1" % r.returncode)
            ok = False
        if "no room in /dev/shm for the handoff of a max_seq prompt" not in err:
            print("shm_full: FAIL: the reason was not given")
            ok = False
        if "rows per call lowered" in err:
            print("shm_full: FAIL: the rows per call were lowered")
            ok = False
        if not ok:
            sys.stdout.write(err[-3000:])
            return 1
    print("shm_full: PASS (stopped at the first warm-up export, reason given)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
