#!/usr/bin/env bash
# Training pod entrypoint: the one place ft_launcher's flags live.
#
#   entrypoint.sh --config tiny --data.path=/data --train.run_dir=/runs/x [--section.key=value ...]
#
# Reads the rendezvous environment PyTorchJob injects (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
# PET_MASTER_ADDR / MASTER_ADDR, PET_MASTER_PORT / MASTER_PORT; a TrainJob sets the PET_* ones only:
# PET_MASTER_ADDR=<tj>-node-0-0.<tj>, port 29500), with local defaults (1 node, 2 workers or NPROC_PER_NODE,
# 127.0.0.1:29500), and runs `ft_launcher ... -m trainer "$@"` (in-job restart layer) through
# trainer/resiliency/launch.py: a node that loses the rendezvous (the node hosting its c10d store is gone) starts a
# new launcher that joins it again, for up to FT_RDZV_REJOIN_TIMEOUT seconds, its node-local snapshots kept; and a
# rank of another node that exits with a permanent code stops this node too, with the same code.
#
# Knobs (environment; the trainer checks the ones that must nest with its own config):
#   TRAINER_NODES                       nodes that train (the rendezvous's size); the pods beyond it (PET_NNODES -
#                                       TRAINER_NODES, the job's spare_nodes) wait in the rendezvous as spares, and one
#                                       takes a lost node's place without waiting for a pod to be scheduled. Default:
#                                       PET_NNODES (no spares; a range's MAX)
#   TRAINER_MIN_NODES                   fewest nodes that train on (elastic: the rendezvous runs MIN:MAX nodes); a
#                                       PET_NNODES=MIN:MAX (a PyTorchJob's elasticPolicy) gives it too. Default: none
#                                       fewer than TRAINER_NODES. Exported to the workers as TRAINER_NODE_RANGE=MIN:MAX
#                                       (the trainer refuses a global batch some size of the range cannot keep)
#   FT_MAX_RESTARTS                     in-job restart budget (worker-group restarts), default 3
#   FT_INITIAL_RANK_HEARTBEAT_TIMEOUT   s until the first heartbeat: start-up + checkpoint load, default 1800
#   FT_RANK_HEARTBEAT_TIMEOUT           s between heartbeats until learned from observed steps and saves;
#                                       must exceed resiliency.hard_timeout_s + termination_grace_s (the
#                                       in-process layer acts first), default 300
#   FT_TERM_TIMEOUT                     s from a forwarded SIGTERM to SIGKILL; must exceed
#                                       resiliency.preemption_grace_s (final checkpoint), default 60
#   FT_WORKERS_STOP_TIMEOUT             s from SIGTERM to SIGKILL when stopping workers to restart, default 15
#   FT_WORKLOAD_CHECK_INTERVAL          s between rank-monitor checks, default 5
#   FT_MONITOR_INTERVAL                 s between ft_launcher's checks of its workers' processes: bounds how long a
#                                       dead worker goes unnoticed (every in-job restart waits up to it), default 0.1
#   FT_RESTART_POLICY                   any-failed (default) or min-healthy
#   FT_LOCAL_ADDR                       this node's address in the rendezvous (--local-addr), default socket.getfqdn().
#                                       The rendezvous numbers a new round's nodes in the order of their addresses and
#                                       then keeps each node's number, so a node keeps its ranks, and the snapshots in
#                                       its memory stay its own, even when a lost store host starts the rendezvous
#                                       anew. A PyTorchJob's pods get their pod names (components/lib/pytorchjob.py),
#                                       a TrainJob's keep their stable FQDNs; several nodes on one machine need one
#                                       each, in node order: 127.0.0.1, 127.0.0.2, ... (the local backend's)
#   FT_RDZV_KEEP_ALIVE_S                s between a node's keep-alives to the rendezvous; a node silent for 3 of them
#                                       is dropped, and only then can the others' next round form: bounds how long a
#                                       lost node holds up the job (NVRx fixes 5 s), default 2
#   FT_RDZV_REJOIN_TIMEOUT              s this node keeps joining the job's rendezvous again after losing it (the
#                                       node hosting its store is gone: trainer/resiliency/launch.py) before the
#                                       pod exits 205 RENDEZVOUS_LOST for the cluster layer, default 600
#   TRAINER_NODE_WAIT_S                 PET_NNODES=MIN:MAX (elastic): s the rendezvous waits for more nodes once MIN
#                                       are in (its last call): after a node is lost with no spare or replacement,
#                                       how long the others wait before they go on without it (train.global_batch
#                                       keeps the global batch), default 30
#   FT_ENABLE_NIC_MONITOR               True/False; default True only where an NVIDIA driver is present
#   TRAINER_STANDBY                     True/False (or 1/0): keep one warm standby worker per local rank
#                                       (trainer/startup/standby.py: torch, the trainer and NVRx imported, its
#                                       CUDA context made), warmed after that rank's worker finished its first step; a worker
#                                       that ft_launcher restarts hands its rank over to it, which skips most of
#                                       the restart's start-up. Costs one Python process and one CUDA context per
#                                       local rank. Default True only where an NVIDIA driver is present
#   TRAINER_FORKSERVER                  True/False (or 1/0): run the node's fork server
#                                       (trainer/startup/forkserver.py), which imports torch, NVRx and the trainer once before ft_launcher starts and then
#                                       forks every worker ft_launcher launches (the first ones and each in-job
#                                       restart's, where no warm standby takes the rank), every warm standby and
#                                       every checkpoint writer, so none of them imports them again. It makes no thread and no CUDA
#                                       context; each forked worker makes its own. Costs one Python process per node
#                                       with those modules imported. If it is gone, processes start the ordinary way
#                                       (one line each says so). Default True
#   TRAINER_COMPILE_AHEAD               0 turns off compiling the run's Triton kernels beside ft_launcher's start
#                                       (the warm-up's compile stage, trainer/startup/warmup.py; on by default where an
#                                       NVIDIA device is present)
#   TRAINER_JOB_SECRET_FILE             a file holding the job's secret, with which every request, reply and replica of
#                                       the peer tier is signed (trainer/checkpoint/peerauth.py). The launch step mounts
#                                       the job's own Secret and sets it; the local launcher writes one per launch.
#                                       Unset: the first rank makes <checkpoint.dir>.peer-secret (0600) beside the
#                                       shared checkpoint directory, and every node reads that one
#   TRAINER_REPLICA_ADDR                this node's address for the peer tier: its replica servers listen there only,
#                                       and the other nodes connect to it (the pod's IP in the launch step's
#                                       manifests; 127.0.0.<k+1> for several local nodes). Default: this host name's
#                                       address
#   PYTORCH_ALLOC_CONF                  the CUDA caching allocator's settings; default expandable_segments:True
#                                       when neither it nor PYTORCH_CUDA_ALLOC_CONF is set (empty counts as unset)
#
# Exit codes (trainer/exitcodes.py): ft_launcher itself exits 1 for every failure, so this script does not
# `exec` it: it runs it as a child (forwarding SIGTERM/SIGINT, so preemption reaches the launcher, which
# forwards it to the workers) and maps the outcome from the exit codes the workers recorded in
# $TRAINER_EXIT_CODE_DIR (last in-job attempt only):
#   a worker exited with a job-ending code (see below)     -> that code: 1-127 (permanent), 201
#                                                             UNHEALTHY_NODE or 204 LAUNCHER_LOST (a new pod)
#   a worker committed its final checkpoint after SIGTERM  -> 202 PREEMPTED        (retryable)
#   SIGTERM received, no final checkpoint reported         -> 143 TERMINATED       (retryable)
#   ft_launcher succeeded                                  -> 0
#   a 1-127 or 201 code recorded without the signal        -> that code
#   anything else: ft_launcher gave up after max restarts  -> 200 RESTART_BUDGET_EXHAUSTED (retryable)
#
# Job-ending exits are never retried in the job: ft_launcher 0.4.1 restarts the worker group on any failure
# (it has no per-exit-code policy), so a worker that exits 1-127, 201 (unhealthy node: do not restart here)
# or 204 (its rank monitor is gone, and ft_launcher never respawns one) sends this script SIGUSR1 after
# recording its code; this script stops the launcher at once (SIGTERM, without the preemption marker: the
# other workers exit without a final checkpoint) and exits with that code after one attempt.
#
# Temporary files: the job gets its own TMPDIR (ft_launcher's torchelastic_* log dirs and rank-monitor
# sockets, the workers' pymp-* dirs, the exit-code dir), removed when this script exits, so workers killed
# by a signal leave nothing in /tmp. Under a TMPDIR that is too long for a unix socket path, /tmp is used.
set -uo pipefail

readonly OK=0 CONFIG_ERROR=2 TERMINATED=143 RESTART_BUDGET_EXHAUSTED=200 UNHEALTHY_NODE=201 PREEMPTED=202 \
  LAUNCHER_LOST=204 RENDEZVOUS_LOST=205

log() { printf 'entrypoint: %s\n' "$*" >&2; }

require_int() {  # name value
  if ! [[ "$2" =~ ^[0-9]+$ ]]; then
    log "$1 must be a non-negative integer; got '$2'"
    exit "$CONFIG_ERROR"
  fi
}

nnodes="${PET_NNODES:-1}"
nproc="${PET_NPROC_PER_NODE:-${NPROC_PER_NODE:-2}}"
node_rank="${PET_NODE_RANK:-0}"
master_addr="${PET_MASTER_ADDR:-${MASTER_ADDR:-127.0.0.1}}"
master_port="${PET_MASTER_PORT:-${MASTER_PORT:-29500}}"
max_restarts="${FT_MAX_RESTARTS:-3}"
initial_hb="${FT_INITIAL_RANK_HEARTBEAT_TIMEOUT:-1800}"
rank_hb="${FT_RANK_HEARTBEAT_TIMEOUT:-300}"
term_timeout="${FT_TERM_TIMEOUT:-60}"
workers_stop_timeout="${FT_WORKERS_STOP_TIMEOUT:-15}"
check_interval="${FT_WORKLOAD_CHECK_INTERVAL:-5}"
monitor_interval="${FT_MONITOR_INTERVAL:-0.1}"
restart_policy="${FT_RESTART_POLICY:-any-failed}"
rejoin_timeout="${FT_RDZV_REJOIN_TIMEOUT:-600}"
keep_alive="${FT_RDZV_KEEP_ALIVE_S:-2}"
node_wait="${TRAINER_NODE_WAIT_S:-30}"
rdzv_id="${FT_RDZV_ID:-resilient-train}"
if [[ -n "${FT_ENABLE_NIC_MONITOR:-}" ]]; then
  nic_monitor="$FT_ENABLE_NIC_MONITOR"
elif [[ -e /proc/driver/nvidia/version ]]; then
  nic_monitor=True
else
  nic_monitor=False  # CPU host: no NVML, no GPU-to-NIC map
fi
standby="${TRAINER_STANDBY:-}"
if [[ -z "$standby" ]]; then
  [[ -e /proc/driver/nvidia/version ]] && standby=1 || standby=0  # on CPU hosts a restart has no CUDA to warm
fi
forkserver="${TRAINER_FORKSERVER:-1}"
for pair in "TRAINER_STANDBY:$standby" "TRAINER_FORKSERVER:$forkserver"; do
  case "${pair#*:}" in True|true|1|False|false|0) ;; *)
    log "${pair%%:*} must be True or False (1 or 0); got '${pair#*:}'"; exit "$CONFIG_ERROR" ;;
  esac
done
[[ "$standby" == [Tt]rue || "$standby" == 1 ]] && standby=1 || standby=0
[[ "$forkserver" == [Tt]rue || "$forkserver" == 1 ]] && forkserver=1 || forkserver=0

[[ "$nnodes" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || { log "PET_NNODES must be N or MIN:MAX (>= 1); got '$nnodes'"; exit "$CONFIG_ERROR"; }
pods="${nnodes##*:}" max_nodes="${TRAINER_NODES:-${nnodes##*:}}" min_nodes="${TRAINER_MIN_NODES:-}"
[[ -z "$min_nodes" && -z "${TRAINER_NODES:-}" ]] && min_nodes="${nnodes%%:*}"  # the operator's MIN:MAX
min_nodes="${min_nodes:-$max_nodes}"
if ! [[ "$max_nodes" =~ ^[1-9][0-9]*$ ]] || (( max_nodes > pods )); then
  log "TRAINER_NODES must be a number of nodes from 1 to PET_NNODES ($nnodes); got '$max_nodes'"
  exit "$CONFIG_ERROR"
fi
if ! [[ "$min_nodes" =~ ^[1-9][0-9]*$ ]] || (( min_nodes > max_nodes )); then
  log "TRAINER_MIN_NODES (or PET_NNODES's MIN) must be a number of nodes from 1 to $max_nodes (TRAINER_NODES or PET_NNODES's MAX); got '$min_nodes'"
  exit "$CONFIG_ERROR"
fi
# Spare pods: the operator counts them in PET_NNODES, the rendezvous must not (a launcher beyond MAX waits).
spares=$(( pods - max_nodes ))
nnodes="$max_nodes" && (( min_nodes < max_nodes )) && nnodes="$min_nodes:$max_nodes"
export TRAINER_NODE_RANGE="$min_nodes:$max_nodes"
for pair in "PET_NPROC_PER_NODE:$nproc" "PET_NODE_RANK:$node_rank" "MASTER_PORT:$master_port" \
            "FT_MAX_RESTARTS:$max_restarts" "FT_INITIAL_RANK_HEARTBEAT_TIMEOUT:$initial_hb" \
            "FT_RANK_HEARTBEAT_TIMEOUT:$rank_hb" "FT_TERM_TIMEOUT:$term_timeout" \
            "FT_WORKERS_STOP_TIMEOUT:$workers_stop_timeout" "FT_WORKLOAD_CHECK_INTERVAL:$check_interval" \
            "FT_RDZV_REJOIN_TIMEOUT:$rejoin_timeout" "FT_RDZV_KEEP_ALIVE_S:$keep_alive" \
            "TRAINER_NODE_WAIT_S:$node_wait"; do
  require_int "${pair%%:*}" "${pair#*:}"
done
if ! [[ "$monitor_interval" =~ ^[0-9]*\.?[0-9]+$ ]] || [[ "$monitor_interval" =~ ^0*\.?0*$ ]]; then
  log "FT_MONITOR_INTERVAL must be a number of seconds > 0; got '$monitor_interval'"
  exit "$CONFIG_ERROR"
fi
case "$restart_policy" in any-failed|min-healthy) ;; *)
  log "FT_RESTART_POLICY must be any-failed or min-healthy; got '$restart_policy'"; exit "$CONFIG_ERROR" ;;
esac
if (( keep_alive < 1 )); then
  log "FT_RDZV_KEEP_ALIVE_S must be at least 1 (seconds); got '$keep_alive'"
  exit "$CONFIG_ERROR"
fi
if (( initial_hb < rank_hb )); then
  log "FT_INITIAL_RANK_HEARTBEAT_TIMEOUT ($initial_hb) must be >= FT_RANK_HEARTBEAT_TIMEOUT ($rank_hb): it also covers start-up and checkpoint load"
  exit "$CONFIG_ERROR"
fi

# ft_launcher's argparse prefix-matches options even after the module name (`--ft` would be taken as an
# ambiguous launcher option). Trainer options are --config/--help-config/--print-config or dotted
# --section.key[=value]; no launcher option contains a dot, so only those forms are passed through.
for arg in "$@"; do
  if [[ "$arg" == --* ]]; then
    key="${arg%%=*}"
    if [[ "$key" != *.* && "$key" != --config && "$key" != --help-config && "$key" != --print-config ]]; then
      log "unsupported trainer argument '$arg': use --config, --help-config, --print-config or --section.key=value"
      exit "$CONFIG_ERROR"
    fi
  fi
done

parent_tmp="${TMPDIR:-/tmp}"
# ft_launcher's unix sockets go in the job's dir (~40 bytes of name in a path of at most 107)
(( ${#parent_tmp} <= 48 )) || parent_tmp=/tmp
job_tmp="$(mktemp -d "$parent_tmp/trainer-job.XXXXXX")" || exit "$RESTART_BUDGET_EXHAUSTED"
# The node-local checkpoint tier: this job's snapshot slots (trainer/checkpoint/slots.py) live in a directory of
# the memory-backed checkpoint.node_local_dir that outlives any worker, so a respawned worker resumes from host
# memory; it is removed when the job ends, however it ends.
node_local_dir=/dev/shm
for arg in "$@"; do [[ "$arg" == --checkpoint.node_local_dir=* ]] && node_local_dir="${arg#*=}"; done
snapshot_dir=""
if mkdir -p -- "$node_local_dir" 2>/dev/null; then
  snapshot_dir="$(mktemp -d "$node_local_dir/resilient-train-job.XXXXXX")" && export TRAINER_SNAPSHOT_DIR="$snapshot_dir"
fi
# Named semaphores and shared memory that workers killed with their whole process group (resource tracker
# included) left in /dev/shm: each worker records its own in owner-<pid> there (trainer/checkpoint/reaper.py);
# a restarted worker removes a dead one's, and this removes the rest when the job ends. Only recorded names.
reap_node_memory() {
  local owner pid rtype name
  [[ -n "$snapshot_dir" ]] || return 0
  for owner in "$snapshot_dir"/owner-*; do
    [[ -f "$owner" ]] || continue
    pid="${owner##*/owner-}"
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    kill -0 "$pid" 2>/dev/null && continue
    while read -r rtype name; do
      [[ "$name" =~ ^/?[A-Za-z0-9._-]+$ ]] || continue
      case "$rtype" in
        semaphore) rm -f -- "/dev/shm/sem.${name#/}" ;;
        shared_memory) rm -f -- "/dev/shm/${name#/}" ;;
      esac
    done < "$owner"
  done
}
standby_pid="" forkserver_pid="" ahead_pid=""
stop_server() {  # $1: pid of a server; the standby server ends its warm standbys (they die with it: PR_SET_PDEATHSIG)
  [[ -n "$1" ]] || return 0
  kill -s TERM "$1" 2>/dev/null
  local i
  for i in {1..50}; do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -s KILL "$1" 2>/dev/null
  wait "$1" 2>/dev/null
}
trap 'stop_server "$standby_pid"; stop_server "$forkserver_pid"; [[ -z "$ahead_pid" ]] || kill "$ahead_pid" 2>/dev/null; reap_node_memory; rm -rf -- "$job_tmp" ${snapshot_dir:+"$snapshot_dir"}' EXIT
exit_dir="$job_tmp/exit-codes"
mkdir "$exit_dir" || exit "$RESTART_BUDGET_EXHAUSTED"
# Each local rank's device memory peak, noted by its worker for the one that takes over after it, which waits for the
# dead one's memory to come back before it allocates (trainer/resiliency/device.py).
mkdir "$job_tmp/device" && export TRAINER_DEVICE_DIR="$job_tmp/device"
export TMPDIR="$job_tmp" TRAINER_EXIT_CODE_DIR="$exit_dir" TRAINER_TERM_TIMEOUT_S="$term_timeout" TRAINER_ENTRYPOINT_PID=$$
# This pod's identity in the job (the ledger tells a node that joined from one that was there: trainer/ledger.py),
# and where its first launcher notes how far the run's ledger went when the pod started (trainer/resiliency/launch.py).
export TRAINER_NODE_ID="${HOSTNAME:-$(hostname)}/$$/${job_tmp##*.}" TRAINER_LEDGER_OFFSET_FILE="$job_tmp/ledger-offset"
export PYTHONUNBUFFERED=1 TRAINER_RDZV_KEEP_ALIVE_S="$keep_alive"
# c10d logs a warning every second while NVRx's monitor thread polls its store ("waitForInput ... timed out");
# keep C++ warnings out of the training log unless asked for (errors, e.g. NCCL failures, are still logged).
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
# Expandable segments: the CUDA caching allocator maps memory into segments that grow on demand instead of
# reserving fixed-size ones, so less reserved memory sits unused between blocks. torchtitan's launcher
# (run_train.sh) exports the same; it lowers a compiled run's peak reserved memory at the same speed per step
# (bench/throughput_suite.sh alloc measures it; BENCHMARKS.md, "Throughput against torchtitan", runs with it). A user's
# setting wins (expandable_segments:False turns it off). Nothing in the trainer shares CUDA tensors between
# processes (CUDA IPC, which expandable segments may not support): the checkpoint writer gets host memory, the
# standby handoff no tensors. Exported before the standby starts, which must see the workers' import-time
# environment (trainer/startup/standby.py).
if [[ -z "${PYTORCH_ALLOC_CONF:-}" && -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi
# NVRx 0.4.1 depends on the `pynvml` shim, which warns at every `import torch` (ft_launcher's included); the trainer
# silences it for itself and its children (trainer/__init__.py), this for the launcher too.
pynvml_warning="ignore:The pynvml package is deprecated:FutureWarning"
[[ ",${PYTHONWARNINGS:-}," == *",$pynvml_warning,"* ]] || export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}$pynvml_warning"
# The run's Triton kernels compiled into Triton's on-disk cache while ft_launcher and the first workers start
# (the warm-up's compile stage, trainer/startup/warmup.py): one process per node, started before ft_launcher so
# that the launcher's own start-up is a head start; the workers see TRAINER_COMPILE_AHEAD=started and start none of their own. It makes no CUDA
# context, logs one line and exits 0; TRAINER_COMPILE_AHEAD=0 turns it off. Its world size is the largest the
# job can have (PET_NNODES=MIN:MAX: MAX), which chooses the kernels of any size above one rank
# (an elastic job that then runs at one rank compiles its one-rank kernels itself, as without this).
if [[ "${TRAINER_COMPILE_AHEAD:-1}" != 0 && -e /dev/nvidiactl ]]; then
  WORLD_SIZE=$(( ${nnodes##*:} * nproc )) LOCAL_RANK=0 python3 -m trainer.startup.warmup "$@" </dev/null >/dev/null &
  ahead_pid=$!
  export TRAINER_COMPILE_AHEAD=started
fi
# The node's fork server (trainer/startup/forkserver.py), started with the environment the workers inherit (a worker whose
# import-time environment differs runs itself; one line says why), before ft_launcher so that it imports while the
# launcher starts. Its socket is under this node's job directory: never shared with another node.
if (( forkserver )) && mkdir "$job_tmp/forkserver"; then
  export TRAINER_FORKSERVER_DIR="$job_tmp/forkserver"
  python3 -m trainer.startup.forkserver serve --dir "$TRAINER_FORKSERVER_DIR" -- "$@" </dev/null &
  forkserver_pid=$!
  export TRAINER_FORKSERVER_PID="$forkserver_pid"
fi
# Warm standby workers (trainer/startup/standby.py), started with the environment the workers inherit, so what they
# imported matches; a worker whose import-time environment differs runs itself (one line says why).
if (( standby )) && mkdir "$job_tmp/standby"; then
  export TRAINER_STANDBY_DIR="$job_tmp/standby"
  python3 -m trainer.startup.standby serve --nproc "$nproc" --dir "$TRAINER_STANDBY_DIR" &
  standby_pid=$!
fi

# Which node hosts the rendezvous's store: where MASTER_ADDR is a name, the pod whose host name it starts with (the
# PyTorchJob's <job>-master-0, a TrainJob's <tj>-node-0-0.<tj>), said explicitly. Left to the launcher (it hosts if the
# address resolves to this machine), a fresh or replacement pod whose own DNS record is not served yet would host nothing
# and every node would wait; a node that cannot reach the store's host yet joins again (RENDEZVOUS_LOST). An IP address or
# localhost (several nodes on one machine): every launcher may host, the first to bind the port does.
is_host=""
if ! [[ "$master_addr" =~ ^[0-9.]+$ || "$master_addr" == *:* || "$master_addr" == localhost ]]; then
  [[ "${master_addr%%.*}" == "$(hostname)" ]] && is_host=true || is_host=false
fi
read -ra launch_cmd <<< "${FT_LAUNCHER:-python3 -m trainer.resiliency.launch}"  # a test's stand-in may replace it
launcher=(
  "${launch_cmd[@]}"
  --nnodes "$nnodes"
  --nproc-per-node "$nproc"
  --node-rank "$node_rank"
  --rdzv-backend c10d
  --rdzv-endpoint "$master_addr:$master_port"
  --rdzv-id "$rdzv_id"
  ${FT_LOCAL_ADDR:+--local-addr "$FT_LOCAL_ADDR"}
  --rdzv-conf "last_call_timeout=$node_wait${is_host:+,is_host=$is_host}"
  --max-restarts "$max_restarts"
  --term-timeout "$term_timeout"
  --workers-stop-timeout "$workers_stop_timeout"
  --monitor-interval "$monitor_interval"
  --ft-initial-rank-heartbeat-timeout "$initial_hb"
  --ft-rank-heartbeat-timeout "$rank_hb"
  --ft-workload-check-interval "$check_interval"
  --ft-restart-policy "$restart_policy"
  --ft-enable-nic-monitor "$nic_monitor"
  -m trainer "$@"
)

preempted=0
forward() {  # $1: signal name
  # The marker tells the workers this SIGTERM is a preemption (final checkpoint), not ft_launcher stopping
  # them for an in-job restart (exit at once). Written before the signal is forwarded.
  [[ "$1" == TERM ]] && { preempted=1; : > "$exit_dir/preempting"; }
  [[ -n "${launcher_pid:-}" ]] && kill -s "$1" "$launcher_pid" 2>/dev/null
}
ends_job() { (( ($1 >= 1 && $1 <= 127) || $1 == UNHEALTHY_NODE || $1 == LAUNCHER_LOST )); }  # exitcodes.ends_job
# The first code a worker recorded that no in-job restart can help, as "<rank> <code>"; empty if none. A rank of
# another node that ended the job (ended-rank-<R>, from trainer/resiliency/launch.py) counts as one of this node's.
job_ending_exit() {
  local f attempt code
  for f in "$exit_dir"/rank-*; do
    [[ -f "$f" ]] || continue
    read -r attempt code < "$f" || continue
    if ends_job "$code"; then printf '%s %s' "${f##*/rank-}" "$code"; return; fi
  done
  for f in "$exit_dir"/ended-rank-*; do
    [[ -f "$f" ]] || continue
    read -r code < "$f" || continue
    if ends_job "$code"; then printf '%s %s' "${f##*/ended-rank-}" "$code"; return; fi
  done
}
stopped=""  # "<rank> <code>" of the exit that made this script stop the launcher
stop_launcher() {  # SIGUSR1 from a worker that recorded a job-ending code (trainer.exitcodes.record_exit)
  [[ -z "$stopped" && -n "${launcher_pid:-}" ]] || return 0
  stopped="$(job_ending_exit)"
  [[ -n "$stopped" ]] || return 0
  log "rank ${stopped% *} exited ${stopped#* }, which no in-job restart can help: stopping ft_launcher"
  kill -s TERM "$launcher_pid" 2>/dev/null
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap stop_launcher USR1

spare_note=""
(( spares )) && spare_note=" (${spares} more pod(s) of the job wait in the rendezvous as spares)"
log "ft_launcher: ${nnodes} node(s) x ${nproc} worker(s)${spare_note}, node rank ${node_rank}, rendezvous ${master_addr}:${master_port}, max restarts ${max_restarts}"
lost_since=""  # when this node lost the rendezvous, while it has not found it again
while :; do
  began=$SECONDS
  "${launcher[@]}" &
  launcher_pid=$!
  rc=0
  while :; do
    wait "$launcher_pid"
    rc=$?
    kill -0 "$launcher_pid" 2>/dev/null || break  # wait returned for a trapped signal: keep waiting
  done
  (( rc == RENDEZVOUS_LOST )) && [[ -z "$stopped" ]] && (( ! preempted )) || break
  # A launcher that ran longer than the window had found the rendezvous again: a new loss opens a new window.
  if [[ -z "$lost_since" ]] || (( SECONDS - began > rejoin_timeout )); then lost_since=$SECONDS; fi
  if (( SECONDS - lost_since > rejoin_timeout )); then
    log "the job's rendezvous at ${master_addr}:${master_port} was not found again in ${rejoin_timeout} s"
    break
  fi
  # The next launcher's in-job attempts count from 0 again: this one's workers' codes are not theirs.
  rm -f -- "$exit_dir"/rank-*
  log "lost the job's rendezvous (the node hosting its store is gone): joining it again, this node's snapshots kept"
  sleep 1
done

# The workers' codes of the last in-job attempt ("<attempt> <code>" per rank).
last_attempt=-1
for f in "$exit_dir"/rank-*; do
  [[ -f "$f" ]] || continue
  read -r attempt code < "$f" || continue
  (( attempt > last_attempt )) && last_attempt=$attempt
done
codes=()
for f in "$exit_dir"/rank-*; do
  [[ -f "$f" ]] || continue
  read -r attempt code < "$f" || continue
  (( attempt == last_attempt )) && codes+=("$code")
done

final=$RESTART_BUDGET_EXHAUSTED
reason="ft_launcher gave up (exit ${rc}) after at most ${max_restarts} in-job restarts"
(( rc == RENDEZVOUS_LOST )) && final=$RENDEZVOUS_LOST && reason="the job's rendezvous was lost and not found again"
permanent=""
for code in "${codes[@]}"; do
  if (( code >= 1 && code <= 127 )) && [[ -z "$permanent" ]]; then permanent=$code; fi
done
if [[ -n "$stopped" ]]; then
  final=${stopped#* }; reason="rank ${stopped% *} exited ${final}; no in-job restart (after one attempt)"
  [[ -f "$exit_dir/ended-rank-${stopped% *}" && ! -f "$exit_dir/rank-${stopped% *}" ]] &&
    reason="rank ${stopped% *}, on another node, exited ${final}; this node stops too"
elif [[ " ${codes[*]} " == *" $PREEMPTED "* ]]; then
  final=$PREEMPTED; reason="preempted: the final checkpoint was committed"
elif (( preempted )); then
  final=$TERMINATED; reason="SIGTERM received; no final checkpoint was reported"
elif (( rc == 0 )); then
  final=$OK; reason="training finished"
elif [[ -n "$permanent" ]]; then
  final=$permanent; reason="a worker exited with permanent code ${permanent}"
elif [[ " ${codes[*]} " == *" $UNHEALTHY_NODE "* ]]; then
  final=$UNHEALTHY_NODE; reason="a worker found this node unhealthy"
fi
log "ft_launcher exit ${rc}; workers' codes (attempt ${last_attempt}): ${codes[*]:-none}; exiting ${final}: ${reason}"
exit "$final"
