#!/usr/bin/env bash
# service.sh — the service set on the GPU machine: dsv4-sched, a prefill
# group and a decode group of GPUS ranks each (group_size = GPUS; rank r of
# each group on GPU r), CUDA backend, synthetic weights of the flash config
# cut to LAYERS layers, driven by dsv4-bench through libdsv4client.
# Run from the repository root with the binaries packed in .carry/
# (tools/gpu-pack.sh BUILD tools/launch/dsv4-launch daemons/sched/dsv4-sched
#  daemons/rank/dsv4-prefill daemons/rank/dsv4-decode tools/bench/dsv4-bench
#  tools/dsv4ctl/dsv4ctl).
#
#   LAYERS=8 GPUS=2 BENCH="-c 1,16 -p 1024 -l 128 -n 32" KILL=1 tests/gpu/service.sh
#   (BENCH="RUN1;RUN2;...": several dsv4-bench runs one after the other,
#   results in bench.json, bench2.json, ...)
#   (TOKENS="--token-range LO:HI" for the prompts' ids, both runs)
#
# MPS=1 [MPS_PREFILL=N] [MPS_DECODE=N] [MPS_PRIO=0]: under an MPS server
# (see below).
# MTP=1: decode ranks with mtp = yes (drafts proposed/accepted in the log).
# DECODE_GROUPS=N (1): N decode groups of GPUS ranks on the same GPUs (they
# share the weights), each with SLOTS (16 / N) streams: one group's
# latency-bound kernels run beside another's MoE (with MPS).
# BURST=1: a second prefill group of GPUS ranks (prefill@GPUS ...), burst
# ranks (prefill@N.burst = yes) at BURST_MPS% of the SMs under MPS (0: all):
# the prompts of an idle service go there, those of a busy one to the first
# group (docs/operations.md "Burst prefill"); BURST_FREE=N sets
# burst_free_slots (the burst group also takes prompts that wait for the
# busy first group while N decode slots are free).
# TEMP (0: greedy) the requests' sampling temperature (dsv4-bench -t).
# PREFILL_SLOTS (1) prompts a prefill rank runs in one forward call,
# PREFILL_CHUNK (2048) rows of a prefill call.
# KILL_BENCH (dsv4-bench options of the load under the kill) and KILL_AFTER
# (seconds before the kill) size that part; COMM=nccl|cudaipc|auto sets the
# groups' communicator (the `comm` key; default: the key's default, auto);
# WARMUP=yes|no sets the `warmup` key (default: the key's default, yes).
# Writes $OUT/bench.json, the daemons' logs ($OUT/launch.log), the ranks
# as dsv4ctl --json ranks lists them once up ($OUT/ranks.json), dsv4ctl
# status before and after, and a line on decode@0's step times (its STATUS=
# windows: all of them, and those with a full batch); KILL=1 then kills decode@1 (decode@0 when
# GPUS=1) (kill -9) under C=16
# load and reports the time until the group serves again and whether any
# request was lost (the script's exit status is then 1, as when a bench
# run fails or the group does not serve again); with KILL_SCHED=1 it kills dsv4-sched instead and
# reports the time until the restarted scheduler is READY and every rank
# has registered again.
set -uo pipefail
# a pack made with tools/gpu-pack.sh --xz: bin/ and lib/ out of it first
tools/gpu-pack.sh --unpack || exit 1
export LD_LIBRARY_PATH=$PWD/.carry/lib PATH=$PWD/.carry/bin:$PATH NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}
LAYERS=${LAYERS:-8}
GPUS=${GPUS:-2}
D=$(mktemp -d /tmp/dsv4svc.XXXX)
mkdir -p "$OUT"
# flash's ratio pattern for the first LAYERS layers, then the MTP layer
ratios=$(python3 -c "n=$LAYERS; print('[' + ','.join(str(0 if i < 2 else (4 if i % 2 == 0 else 128)) for i in range(n)) + ',0]')")
# BACKEND=cpu: the same set on the CPU backend with a tiny checkpoint (a dry
# run of this script where there is no GPU)
extra="--backend cuda --synthetic-weights 7 --preset flash --set num_hidden_layers=$LAYERS"
extra="$extra --set 'compress_ratios=$ratios'"
ckpt=""
if [ "${BACKEND:-cuda}" = cpu ]; then
    dsv4-mkmodel --preset tiny --out "$D/model" > /dev/null
    extra="--backend cpu"
    ckpt="checkpoint = $D/model"
fi
# RANK_ARGS: more options for every rank (e.g. -v: info lines, with each
# prompt's prefill_done times, in launch.log)
extra="$extra ${RANK_ARGS:-}"
# DECODE_KTRACE=1: the decode ranks run under tools/ktrace (libdsv4ktrace.so
# packed in .carry/bin), one kernel timeline per process in
# $OUT/decode-ktrace.PID (tools/ktrace/ktrace_sum.py).  The tracer records
# every graph node at each launch: the gaps between steps it shows are its
# own, not the service's (docs/perf.md run 34).
kt=""
[ "${DECODE_KTRACE:-0}" = 1 ] &&
    kt="env KTRACE_OUT=$OUT/decode-ktrace.\$\$ LD_PRELOAD=$PWD/.carry/bin/libdsv4ktrace.so"
for r in prefill decode; do
    pre=""
    [ $r = decode ] && pre=$kt
    printf '#!/bin/sh\nexec %s %s "$@" %s\n' "$pre" "$(command -v dsv4-$r)" "$extra" > "$D/dsv4-$r"
    chmod +x "$D/dsv4-$r"
done
cat > "$D/dsv4.conf" <<EOC
client_endpoint = ipc://$D/client.sock
rank_endpoint = ipc://$D/rank.sock
admin_endpoint = ipc://$D/ctl.sock
tokenizer = none
heartbeat_ms = 1000
liveness = 30
group_size = $GPUS
slots = ${SLOTS:-$((16 / ${DECODE_GROUPS:-1}))}
max_batch = ${SLOTS:-$((16 / ${DECODE_GROUPS:-1}))}
prefill_slots = ${PREFILL_SLOTS:-1}
prefill_chunk = ${PREFILL_CHUNK:-2048}
max_seq = ${MAX_SEQ:-4096}
$ckpt
EOC
[ -n "${COMM:-}" ] && echo "comm = $COMM" >> "$D/dsv4.conf"
# WARMUP=no: the ranks skip their start-up warm-up calls (the `warmup` key)
[ -n "${WARMUP:-}" ] && echo "warmup = $WARMUP" >> "$D/dsv4.conf"
# MTP=1: speculative decoding with the MTP layer on the decode ranks
[ "${MTP:-0}" = 1 ] && echo "decode.mtp = yes" >> "$D/dsv4.conf"
# DISAGG=1: the prefill group on GPUs 0 .. GPUS-1, the decode group on
# GPUS .. 2*GPUS-1 (issue 8's disaggregated shape; weights not shared)
if [ "${DISAGG:-0}" = 1 ]; then
    printf 'prefill.gpu = 0\ndecode.gpu = %d\n' "$GPUS" >> "$D/dsv4.conf"
fi
# MPS=1: an MPS server for the GPUs, so prefill kernels run beside the decode
# steps instead of time-sliced with them; MPS_PREFILL=N gives the prefill
# ranks N% of the SMs (prefill.mps_sm_percent), MPS_DECODE likewise
if [ "${MPS:-0}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY=$D/mps CUDA_MPS_LOG_DIRECTORY=$D/mpslog
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS server started (prefill ${MPS_PREFILL:-100}%, decode ${MPS_DECODE:-100}% of the SMs)"
    [ -n "${MPS_PREFILL:-}" ] && echo "prefill.mps_sm_percent = $MPS_PREFILL" >> "$D/dsv4.conf"
    [ -n "${MPS_DECODE:-}" ] && echo "decode.mps_sm_percent = $MPS_DECODE" >> "$D/dsv4.conf"
    # MPS_PRIO=0: every rank an MPS client of normal priority (the default
    # puts prefill ranks below normal: cuda_priority = decode)
    [ "${MPS_PRIO:-}" = 0 ] && export CUDA_MPS_CLIENT_PRIORITY=0
fi
n_prefill=$GPUS
if [ "${BURST:-0}" = 1 ]; then
    for n in $(seq "$GPUS" $((2 * GPUS - 1))); do
        printf 'prefill@%d.burst = yes\nprefill@%d.mps_sm_percent = %d\n' "$n" "$n" \
            "${BURST_MPS:-0}" >> "$D/dsv4.conf"
    done
    n_prefill=$((2 * GPUS))
    [ -n "${BURST_FREE:-}" ] && echo "burst_free_slots = $BURST_FREE" >> "$D/dsv4.conf"
fi
n_decode=$((GPUS * ${DECODE_GROUPS:-1}))
n_ranks=$((n_prefill + n_decode))
# LAUNCH_ARGS: more dsv4-launch options (e.g. "-v -v": every daemon's debug lines)
dsv4-launch ${LAUNCH_ARGS:-} -f "$D/dsv4.conf" -P "$n_prefill" -D "$n_decode" -r 500 -w 120 -T 600 -t 30 \
    --sched-bin "$(command -v dsv4-sched)" --prefill-bin "$D/dsv4-prefill" \
    --decode-bin "$D/dsv4-decode" --notify-log "$D/notify.log" > "$OUT/launch.log" 2>&1 &
lpid=$!
ctl() { dsv4ctl --admin "ipc://$D/ctl.sock" "$@"; }
t0=$SECONDS
for i in $(seq 1 300); do
    n=$(ctl --json ranks 2>/dev/null | grep -c '"state": "ready"')
    [ "${n:-0}" -ge "$n_ranks" ] &&
        { [ "$GPUS" = 1 ] || grep -q "communicator of epoch" "$OUT/launch.log"; } && break
    kill -0 $lpid 2> /dev/null || { echo "dsv4-launch exited"; tail -30 "$OUT/launch.log"; exit 1; }
    [ "$i" = 300 ] && { echo "the ranks are not ready after 300 s"; ctl ranks; kill $lpid
                        wait $lpid; exit 1; }
    sleep 1
done
echo "set up in $((SECONDS - t0)) s ($n_prefill+$n_decode ranks, flash $LAYERS layers)"
sleep 2
ctl ranks
# each rank's GPU as its READY said it (the burst choice's `device`)
ctl --json ranks > "$OUT/ranks.json" 2>&1
# BENCH may hold several runs separated by ';' (bench.json, bench2.json, ...)
rc=0 i=0
IFS=';' read -ra runs <<< "${BENCH:--c 1,16 -p 1024 -l 128 -n 32}"
for run in "${runs[@]}"; do
    i=$((i + 1)) sfx=""
    [ $i -gt 1 ] && sfx=$i
    echo "== dsv4-bench $run"
    # shellcheck disable=SC2086
    dsv4-bench -e "ipc://$D/client.sock" -t ${TEMP:-0} ${TOKENS:-} $run \
        -j "$OUT/bench$sfx.json" 2>&1 | tee "$OUT/bench$sfx.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
if [ "${KILL:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    dsv4-bench -e "ipc://$D/client.sock" -t ${TEMP:-0} ${TOKENS:-} ${KILL_BENCH:--c 16 -p 256 -l 256 -n 48} -w 0 \
        -j "$OUT/kill.json" > "$OUT/kill.txt" 2>&1 &
    bpid=$!
    sleep "${KILL_AFTER:-8}"
  if [ "${KILL_SCHED:-0}" = 1 ]; then
    # KILL_SCHED=1: kill -9 of dsv4-sched instead; dsv4-launch keeps its
    # listeners and starts it again, the ranks register again and the
    # clients resend what was in flight with `resume` (docs/protocol.md §4.6)
    victim=$(grep "^sched START" "$D/notify.log" | tail -1 | sed 's/.*pid=\([0-9]*\).*/\1/')
    ns=$(grep -c "^sched NOTIFY READY=1" "$D/notify.log")
    tk=$(date +%s.%N) tready="" tranks=""
    kill -9 "$victim"
    echo "kill -9 dsv4-sched (pid $victim)"
    for i in $(seq 1 1200); do
        if [ -z "$tready" ] && [ "$(grep -c "^sched NOTIFY READY=1" "$D/notify.log")" -gt "$ns" ]; then
            tready=$(date +%s.%N)
        fi
        if [ -n "$tready" ] &&
            [ "$(ctl --json ranks 2>/dev/null | grep -c '"state": "ready"')" -ge "$n_ranks" ]; then
            tranks=$(date +%s.%N)
            break
        fi
        sleep 0.05
    done
    [ -n "$tready" ] && echo "kill -9 to the restarted dsv4-sched READY: $(python3 -c "print(round($tready - $tk, 2))") s"
    [ -n "$tranks" ] && echo "kill -9 to every rank registered again (serving again): $(python3 -c "print(round($tranks - $tk, 2))") s"
    grep -c "resumes after" "$OUT/launch.log" | sed "s/^/requests resumed (the scheduler's log): /"
  else
    kr=$((GPUS - 1))   # the killed decode rank: decode@1 of a group of 2, else decode@0
    victim=$(grep "decode@$kr START" "$D/notify.log" | tail -1 | sed 's/.*pid=\([0-9]*\).*/\1/')
    survivor=$(grep "decode@0 START" "$D/notify.log" | tail -1 | sed 's/.*pid=\([0-9]*\).*/\1/')
    nc=$(grep -c 'decode/0: communicator of epoch .* sent' "$OUT/launch.log")
    nr=$(grep -c "decode@$kr NOTIFY READY=1" "$D/notify.log")
    tk=$(date +%s.%N) tready="" tr="" killed=0
    # a rank that is already gone (a set that did not come up) gives no
    # figure: the wait below would time out and report its own length
    if [ -n "$victim" ] && kill -9 "$victim"; then
        killed=1
        echo "kill -9 decode@$kr (pid $victim)"
        # serving again: the restarted rank is READY, then the group's next
        # communicator (scheduler: "group decode/0: communicator of epoch N sent")
        for i in $(seq 1 1200); do
            if [ -z "$tready" ] && [ "$(grep -c "decode@$kr NOTIFY READY=1" "$D/notify.log")" -gt "$nr" ]; then
                tready=$(date +%s.%N)
            fi
            if { [ "$GPUS" = 1 ] && [ -n "$tready" ]; } ||
                [ "$(grep -c 'decode/0: communicator of epoch .* sent' "$OUT/launch.log")" -gt "$nc" ]; then
                tr=$(date +%s.%N)
                break
            fi
            sleep 0.05
        done
    else
        echo "kill -9 decode@$kr: no running process (pid '${victim}'), nothing killed"
    fi
    [ -n "$tready" ] && echo "kill -9 to the restarted decode@$kr READY: $(python3 -c "print(round($tready - $tk, 2))") s"
    if [ -n "$tr" ]; then
        echo "kill -9 to group re-formed (serving again): $(python3 -c "print(round($tr - $tk, 2))") s"
    else
        [ $killed = 1 ] && echo "kill -9: the group did not serve again within 60 s"
        rc=1
    fi
    now0=$(grep "decode@0 START" "$D/notify.log" | tail -1 | sed 's/.*pid=\([0-9]*\).*/\1/')
    [ "$now0" = "$survivor" ] && kept=yes || kept="NO (pid $survivor -> $now0)"
    [ "$GPUS" -gt 1 ] && echo "survivor decode@0 kept its process: $kept"
    grep -E "group_comm: joined|group_close: aborted|abort did not return" "$OUT/launch.log" |
        tail -6
  fi
    wait $bpid
    kb=$?
    echo "bench under the kill: exit $kb"
    [ "$kb" = 0 ] || rc=1   # a request lost (or the bench could not run)
    grep -vE "^dsv4-bench: " "$OUT/kill.txt" | tail -3
fi
ctl status
# the prompts each prefill rank took (PLACED; a burst rank's line says so)
ctl ranks
# decode@0's once-a-second STATUS= windows: those with at least slots - 1
# streams a step show the model-level step, the mean over all of them how
# much the prefills beside it cost
full=$(( ${SLOTS:-$((16 / ${DECODE_GROUPS:-1}))} - 1 ))
grep "decode@0 .*STATUS" "$D/notify.log" |
    grep -oE "[0-9]+ steps \([0-9]+ stream-steps\) in [0-9.]+ s, forward [0-9.]+ ms a step" |
    awk -v full="$full" '{ st = $3; gsub(/\(/, "", st)
        if ($1 > 0) { n++; t += $9; if (st / $1 >= full) { nf++; tf += $9; if ($9 > mf) mf = $9 } } }
        END { if (n) printf "decode@0 STATUS windows: %d with steps, forward mean %.2f ms a step; " \
                            "%d with >= %d streams a step: mean %.2f, max %.2f ms\n",
                            n, t / n, nf, full, nf ? tf / nf : 0, mf }'
[ "${MTP:-0}" = 1 ] && grep -h "mtp drafts" "$D/notify.log" "$OUT/launch.log" | tail -4
kill -TERM $lpid; wait $lpid
echo "dsv4-launch exit $?"
cp "$D/notify.log" "$OUT/" 2> /dev/null
if [ "${MPS:-0}" = 1 ]; then
    echo quit | nvidia-cuda-mps-control
    cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mpslog" 2> /dev/null
fi
exit $rc
