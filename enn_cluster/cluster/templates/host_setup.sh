# >>> host (shared snippet: enn_cluster/cluster/templates/host_setup.sh; runs on the host before srun)
# Every value read at run time is data: it is checked to be digits before any arithmetic
# (bash evaluates `a[$(cmd)]` inside $((...)), so a file holding that would run cmd).
enn_digits() { case "$1" in ''|*[!0-9]*) return 1 ;; esac; [ "${#1}" -le 12 ]; }
# RUN_DIR/requeue is writable by the job (often by a group): a file there is read only when
# it is a regular file, never a symlink (a FIFO would block this shell until the time limit),
# and written only by a rename into a requeue/ that is a real directory.
enn_regular() { [ -f "$1" ] && [ ! -L "$1" ]; }
enn_write_requeue() {
  local dir="$ENN_RUN_DIR/@REQUEUE@" tmp
  if [ -L "$dir" ] || ! mkdir -p -- "$dir" || [ -L "$dir" ]; then
    echo "enn: $dir is not a directory of this run; not writing $1" >&2
    return 1
  fi
  tmp=$(mktemp -- "$dir/.enn-write.XXXXXX") || return 1
  # mktemp makes 0600: the mode every other file of the run has (the job's umask)
  chmod "$(printf '%o' "$(( 0666 & ~$(umask) ))")" -- "$tmp" 2>/dev/null || true
  if ! { printf '%s\n' "$2" > "$tmp" && mv -f -T -- "$tmp" "$1"; }; then
    rm -f -- "$tmp"
    return 1
  fi
}
# Rendezvous port from the job id, as the worker derives it: stable across requeues, in
# @MASTER_PORT_BASE@-@MASTER_PORT_LAST@, below the kernel's ephemeral ports (32768-60999) that outgoing connections take.
# This shell runs on the job's first node, where rank 0 listens: a port something already
# listens on (another job whose id matches modulo @MASTER_PORT_SPAN@, a service) is passed over.
enn_port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if [ -z "${MASTER_PORT:-}" ] && enn_digits "${SLURM_JOB_ID:-}"; then
  enn_port="$((@MASTER_PORT_BASE@ + 10#$SLURM_JOB_ID % @MASTER_PORT_SPAN@))"
  for _ in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16; do
    enn_port_taken "$enn_port" || break
    echo "enn: port $enn_port is taken on $(hostname); trying the next one" >&2
    enn_port="$((@MASTER_PORT_BASE@ + (enn_port - @MASTER_PORT_BASE_LESS_1@) % @MASTER_PORT_SPAN@))"
  done
  export MASTER_PORT="$enn_port"
fi
# Requeue from the host: inside a Pyxis container `scontrol` is missing. When srun returns,
# this EXIT trap requeues the job (it resumes from the newest complete checkpoint):
# - a worker refused its input (exit 2) and left RUN_DIR/requeue/refused-JOB_ID: never,
#   whatever srun returns (a peer that --kill-on-bad-exit terminated makes it 143);
# - a worker stopped by USR2/TERM checkpointed and left RUN_DIR/requeue/JOB_ID: always;
# - the step failed (a rank died; not exit 2, bad input): at most ENN_MAX_RESTARTS times.
enn_requeue_if_asked() {
  local rc=$1 marker refused failures_file failures=0 why per_node least
  if ! enn_digits "${SLURM_JOB_ID:-}" || ! enn_digits "${ENN_MAX_RESTARTS:-}"; then
    echo "enn: SLURM_JOB_ID or ENN_MAX_RESTARTS is not a whole number; not requeueing" >&2
    return 1
  fi
  marker="$ENN_RUN_DIR/@REQUEUE@/@MARK_REQUEUE@$SLURM_JOB_ID"
  refused="$ENN_RUN_DIR/@REQUEUE@/@MARK_REFUSED@$SLURM_JOB_ID"
  failures_file="$ENN_RUN_DIR/@REQUEUE@/@MARK_FAILURES@$SLURM_JOB_ID"
  if [ -e "$refused" ] || [ -L "$refused" ]; then
    why="(its note is not a regular file)"
    enn_regular "$refused" && why=$(head -n 1 -- "$refused" | head -c 400)
    echo "enn: job $SLURM_JOB_ID refused its input (exit 2), not requeueing: $why" >&2
    return 1
  elif [ -e "$marker" ]; then
    rm -f -- "$marker"
    why="stopped with a checkpoint"
  elif [ "$rc" -ne 0 ] && [ "$rc" -ne 2 ]; then
    if enn_regular "$failures_file"; then
      failures=$(head -c 16 -- "$failures_file" | tr -d '\n')
    elif [ -e "$failures_file" ] || [ -L "$failures_file" ]; then
      failures="not a regular file"
    fi
    if ! enn_digits "$failures"; then
      echo "enn: $failures_file does not hold a retry count; not requeueing (remove it to allow retries)" >&2
      return 1
    fi
    failures=$((10#$failures))
    if [ "$failures" -ge "$((10#$ENN_MAX_RESTARTS))" ]; then
      echo "enn: job $SLURM_JOB_ID failed (exit $rc) after $failures retries (limit $ENN_MAX_RESTARTS)" >&2
      return 1
    fi
    enn_write_requeue "$failures_file" "$((failures + 1))" || return 1
    why="failed (exit $rc), retry $((failures + 1)) of $ENN_MAX_RESTARTS"
  else
    return 1
  fi
  echo "enn: requeueing job $SLURM_JOB_ID: $why" >&2
  trap '' TERM  # the requeue TERMs this shell: finish this function first (within KillWait)
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "enn: scontrol requeue $SLURM_JOB_ID failed; resubmit to continue from the checkpoint" >&2
    return 1
  fi
  # Slurm fixes a job's task count when it first allocates it, so a requeued --nodes
  # MIN-MAX job would wait for all MAX nodes again (a lost node: forever). Back to MIN
  # nodes' worth (one task per node, as enn-submit asks for a range; an admin's
  # --ntasks-per-node where given): the next allocation takes what is free, counts anew.
  if enn_digits "${ENN_MIN_NODES:-}"; then
    per_node="${SLURM_NTASKS_PER_NODE:-1}" least=$((10#$ENN_MIN_NODES))
    enn_digits "$per_node" || per_node=1
    if enn_digits "${ENN_SPARE_NODES:-}"; then least=$((least + 10#$ENN_SPARE_NODES)); fi
    scontrol update "JobId=$SLURM_JOB_ID" "NumTasks=$((least * 10#$per_node))" \
      || echo "enn: could not reset the task count of job $SLURM_JOB_ID; it waits for $SLURM_JOB_NUM_NODES nodes" >&2
  fi
  return 0
}
# The job's last word, when this shell leaves for good (not requeued): RUN_DIR/requeue/
# ended-JOB_ID (rc, time, and after a node loss below the minimum: lost, nodes, min). No task
# of the job runs any more; Slurm may still hold it COMPLETING for minutes while it waits
# for a lost node's cleanup (SlurmdTimeout), and the record is what frees the run for
# `resume` then (storage/node_loss.py, run_lock) and what `status` explains.
enn_on_exit() {
  local rc=$?
  enn_requeue_if_asked "$rc" && return 0
  enn_digits "${SLURM_JOB_ID:-}" || return 0
  enn_write_requeue "$ENN_RUN_DIR/@REQUEUE@/@MARK_ENDED@$SLURM_JOB_ID" "$(printf 'rc=%s\ntime=%s%s' \
    "$rc" "$(date +%s)" "${enn_short:+$'\n'$enn_short}")" || true
}
trap enn_on_exit EXIT
# Stop requests reach the workers through the run directory, never as a step signal: under
# Pyxis with use_squashfuse=1 a step signal also kills Enroot's fuse daemons ("Bus error").
# Slurm's warning (--signal=B:USR2@N) and `scancel --batch --signal=USR2 JOB` reach this
# shell only; the trap records RUN_DIR/requeue/stop-JOB_ID, which rank 0 polls every step.
# What an earlier attempt of this job id left (a Slurm-side requeue kills this shell before
# its EXIT trap runs) must neither stop this attempt nor decide its requeue.
enn_stop_file="$ENN_RUN_DIR/@REQUEUE@/@MARK_STOP@$SLURM_JOB_ID"
rm -f -- "$enn_stop_file" "$ENN_RUN_DIR/@REQUEUE@/@MARK_REQUEUE@$SLURM_JOB_ID" "$ENN_RUN_DIR/@REQUEUE@/@MARK_REFUSED@$SLURM_JOB_ID" \
  "$ENN_RUN_DIR/@REQUEUE@/@MARK_RELAUNCH@$SLURM_JOB_ID" "$ENN_RUN_DIR/@REQUEUE@/@MARK_PROBING@$SLURM_JOB_ID" \
  "$ENN_RUN_DIR/@REQUEUE@/@MARK_ENDED@$SLURM_JOB_ID"
enn_short=""  # lost=..., nodes=..., min=... when a lost node leaves fewer than ENN_MIN_NODES
enn_request_stop() {
  enn_write_requeue "$enn_stop_file" "$(date +%s)" || return 0
  echo "enn: USR2: asked the workers to checkpoint and stop" >&2
}
trap enn_request_stop USR2
# srun runs in the background while this shell waits, so that the USR2 trap runs at once
# (bash runs traps only between commands). A function, so submitit's srun line uses it too.
# Lose a node, keep training (--nodes MIN-MAX: ENN_MIN_NODES set, sbatch --no-kill): the
# ranks on the other nodes fail within seconds, but srun waits for the dead node's tasks
# until the controller declares it down (SlurmdTimeout, often 300 s). So a watcher looks
# every quarter second whether the step's tasks on this node are gone while srun still
# waits; then a short probe step asks every node of the step at once. If some do not
# answer and at least ENN_MIN_NODES do, srun is abandoned and the same command starts
# again, a new step on the nodes that answer (same job: same MASTER_PORT and lock; the
# rendezvous keys carry the step id, so no rank of the old step joins). The workers resume
# from the newest complete checkpoint at the new world size and record the loss
# (RUN_DIR/requeue/relaunch-JOB_ID).
# Fewer than ENN_MIN_NODES: srun is abandoned as failed and the EXIT trap decides as above.
enn_name_ok() { [[ "$1" =~ ^[A-Za-z0-9._-]{1,64}$ ]]; }
enn_step_tasks_here() {  # tasks of a step other than the batch one on this node, or no answer
  local out
  out=$(scontrol listpids "$SLURM_JOB_ID" 2>/dev/null) || return 0
  awk 'NR > 1 && $3 ~ /^[0-9]+$/ && $4 ~ /^[0-9]+$/ {found = 1} END {exit !found}' <<< "$out"
}
# The probe decides once the answers stop coming, not when the dead node's srun times out:
# once $1 nodes have answered, this shell's own among them, it waits for more as long again
# as the answers took (at least 1 s; each later answer starts that wait anew), and ENN_PROBE_S
# in all at most. A slow controller slows every answer, the own node's too, so the wait
# grows with it and a live node is not taken for lost; the own node silent: no decision.
enn_probe_grace_ms() {  # $1: ms from the probe's start to the newest answer -> ms to wait on
  local took=$((10#$1))
  echo "$(( took > 1000 ? took : 1000 ))"
}
enn_probe_nodes() {  # $1 how many must answer, $2 this shell's node ("": none), the nodes
  # after: those that answer, one a line (timeout runs the srun program, not the function)
  local need=$1 self=$2 limit=15 dir node i pids=() start now last=0 count seen=0 mine running
  shift 2
  if enn_digits "${ENN_PROBE_S:-}"; then limit=$((10#$ENN_PROBE_S)); fi
  dir=$(mktemp -d) || return 0
  start=$(date +%s%3N)
  for i in $(seq 1 "$#"); do
    node=${!i}
    ( timeout "$limit" srun --overlap --mem=0 --nodes=1 --ntasks=1 --ntasks-per-node=1 \
        --nodelist="$node" --quiet --output=/dev/null --error=/dev/null true &
      probe=$!
      trap 'kill "$probe" 2>/dev/null; exit 1' TERM
      if wait "$probe"; then : > "$dir/$i"; fi ) </dev/null >/dev/null 2>&1 &
    pids+=("$!")
  done
  while :; do
    sleep 0.1
    now=$(( $(date +%s%3N) - start ))
    count=0 mine=""
    for i in $(seq 1 "$#"); do
      [ -e "$dir/$i" ] || continue
      count=$((count + 1))
      [ "${!i}" != "$self" ] || mine=1
    done
    [ "$count" -le "$seen" ] || { seen=$count last=$now; }
    if [ "$count" -ge "$#" ] || [ "$now" -ge "$((limit * 1000))" ]; then break; fi
    running=""
    for i in "${pids[@]}"; do
      if kill -0 "$i" 2>/dev/null; then running=1; break; fi
    done
    [ -n "$running" ] || break  # every probe has ended
    if [ "$count" -ge "$need" ] && { [ -z "$self" ] || [ -n "$mine" ]; } \
        && [ "$now" -ge "$((last + $(enn_probe_grace_ms "$last")))" ]; then
      break
    fi
  done
  kill "${pids[@]}" 2>/dev/null || true  # the probes still waiting, their srun with them
  wait "${pids[@]}" 2>/dev/null || true
  for i in $(seq 1 "$#"); do
    if [ -e "$dir/$i" ]; then echo "${!i}"; fi
  done
  rm -rf -- "$dir"
}
enn_watch_step() {  # $1 srun's pid, $2 the decision file; the nodes in enn_nodes
  # Every quarter second (a local question to slurmd, not the controller): the tasks gone
  # twice in a row is only a reason to ask; the probe decides, so a slow step (its tasks
  # still here) or a step ending everywhere (every node answers) is never a loss.
  local seen=0 gone=0 ended="" alive lost node probed
  while kill -0 "$1" 2>/dev/null; do
    sleep 0.25
    if enn_step_tasks_here; then seen=1 gone=0 ended=""; continue; fi
    [ "$seen" = 1 ] && gone=$((gone + 1)) && ended="${ended:-$(date +%s.%N)}"
    [ "$gone" -ge 2 ] || continue  # gone twice: srun waits on another node
    mkdir -p -- "$ENN_RUN_DIR/@REQUEUE@" && date +%s > "$ENN_RUN_DIR/@REQUEUE@/@MARK_PROBING@$SLURM_JOB_ID"
    echo "enn: the step's tasks on $(hostname) ended but srun waits: probing ${enn_nodes[*]}" >&2
    probed=$(date +%s.%N)
    alive=$(enn_probe_nodes "$((10#$ENN_MIN_NODES))" "${SLURMD_NODENAME:-}" "${enn_nodes[@]}" \
      | sort | paste -sd, -)
    lost=""
    for node in "${enn_nodes[@]}"; do
      case ",$alive," in *",$node,"*) ;; *) lost="${lost:+$lost,}$node" ;; esac
    done
    rm -f -- "$ENN_RUN_DIR/@REQUEUE@/@MARK_PROBING@$SLURM_JOB_ID"
    if [ -z "$lost" ]; then gone=-40; continue; fi  # every node answers: not a lost node
    if [ -n "${SLURMD_NODENAME:-}" ] && [[ ",$lost," == *",$SLURMD_NODENAME,"* ]]; then
      # this shell's own node did not answer: the probe (the controller) is what is slow
      echo "enn: the probe did not reach $SLURMD_NODENAME itself; not deciding on it" >&2
      gone=-40
      continue
    fi
    printf 'lost=%s\nnodes=%s\nended=%s\nprobed=%s\ndetected=%s\n' "$lost" "$alive" "$ended" \
      "$probed" "$(date +%s.%N)" > "$2"
    kill -KILL "$1" 2>/dev/null
    return 0
  done
}
# Spare nodes (ENN_SPARE_NODES=S, enn-submit --spare-nodes): the job holds S nodes more than
# it trains on; the step runs on the others, this shell's own node first (the watcher looks
# for the step's tasks here). After a lost node the step starts again on as many nodes as
# before, a spare in the lost one's place: the same world size, no resharding. With too
# few left it shrinks, as a range does, down to ENN_MIN_NODES.
enn_pick_nodes() {  # $1 how many, the nodes after -> those the step runs on, comma-separated
  local want=$1 node picked=() self="${SLURMD_NODENAME:-}"
  shift
  for node in "$@"; do [ "$node" != "$self" ] || picked=("$self"); done
  for node in "$@"; do
    [ "${#picked[@]}" -lt "$want" ] || break
    [ "$node" = "$self" ] || picked+=("$node")
  done
  (IFS=,; echo "${picked[*]}")
}
srun() {
  local pid watcher rc decision="$ENN_RUN_DIR/@REQUEUE@/@MARK_DECISION@$SLURM_JOB_ID" lost alive tpn
  local relaunch=0 step_args=() node watch=0 train=0 spare=0 picked left stepped swapped
  tpn="${ENN_GPUS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-}}"
  if enn_digits "${ENN_MIN_NODES:-}" && enn_digits "$tpn"; then
    watch=1
    read -r -a enn_nodes <<< "$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd' ' -)"
    stepped=$(IFS=,; echo "${enn_nodes[*]}")  # the nodes the step runs on
    # A range asks sbatch for one task per node (job_script.allocation): the step starts tpn
    # tasks on every node Slurm granted but the spares, so the world size is what was granted.
    if enn_digits "${SLURM_JOB_NUM_NODES:-}"; then
      if enn_digits "${ENN_SPARE_NODES:-}"; then spare=$((10#$ENN_SPARE_NODES)); fi
      train=$((10#$SLURM_JOB_NUM_NODES - spare))
      step_args=("--nodes=$train" "--ntasks-per-node=$((10#$tpn))" "--ntasks=$((train * 10#$tpn))")
      if [ "$spare" -gt 0 ] && [ "${#enn_nodes[@]}" -eq "$((10#$SLURM_JOB_NUM_NODES))" ]; then
        picked=$(enn_pick_nodes "$train" "${enn_nodes[@]}")
        step_args+=("--nodelist=$picked")
        stepped=$picked
        echo "enn: training on $picked, $spare spare node(s) held" >&2
      fi
    fi
  fi
  while :; do
    rm -f -- "$decision"
    command srun ${step_args[@]+"${step_args[@]}"} "$@" &
    pid=$!
    watcher=""
    if [ "$watch" = 1 ]; then
      enn_watch_step "$pid" "$decision" &
      watcher=$!
    fi
    while :; do
      wait "$pid" && rc=0 || rc=$?
      kill -0 "$pid" 2>/dev/null || break
    done
    # the watcher may be gone already (it returns once it killed srun): under `set -e` a
    # failed kill here would end the batch shell instead of relaunching
    [ -z "$watcher" ] || { kill "$watcher" 2>/dev/null || true; wait "$watcher" 2>/dev/null || true; }
    rm -f -- "$ENN_RUN_DIR/@REQUEUE@/@MARK_PROBING@$SLURM_JOB_ID"
    [ -s "$decision" ] || break
    lost=$(sed -n 's/^lost=//p' "$decision") alive=$(sed -n 's/^nodes=//p' "$decision")
    read -r -a enn_nodes <<< "${alive//,/ }"
    for node in "${enn_nodes[@]}"; do enn_name_ok "$node" || enn_nodes=(); done
    if [ "${#enn_nodes[@]}" -lt "$((10#$ENN_MIN_NODES))" ]; then
      echo "enn: lost node(s) $lost; ${#enn_nodes[@]} answer, fewer than the job's minimum $ENN_MIN_NODES" >&2
      enn_short=$(printf 'lost=%s\nnodes=%s\nmin=%s' "$lost" "$alive" "$((10#$ENN_MIN_NODES))")
      rc=1
      break
    fi
    relaunch=$((relaunch + 1))
    export ENN_RELAUNCH="$relaunch"
    # as many nodes as the step had (a spare in a lost node's place), else all that answer
    if [ "$train" -le 0 ] || [ "$train" -gt "${#enn_nodes[@]}" ]; then train=${#enn_nodes[@]}; fi
    picked=$(enn_pick_nodes "$train" "${enn_nodes[@]}")
    left="" swapped=""
    for node in "${enn_nodes[@]}"; do  # the spares still held, the ones taken into the step
      case ",$picked," in
        *",$node,"*) case ",$stepped," in *",$node,"*) ;; *) swapped="${swapped:+$swapped,}$node" ;; esac ;;
        *) left="${left:+$left,}$node" ;;
      esac
    done
    stepped=$picked
    { grep -v '^nodes=' -- "$decision" || true; echo "nodes=$picked"; echo "spares=$left"
      echo "spare_in=$swapped"
      echo "relaunch=$relaunch"; echo "world=$((train * 10#$tpn))"
      echo "launched=$(date +%s.%N)"; } > "$ENN_RUN_DIR/@REQUEUE@/@MARK_RELAUNCH@$SLURM_JOB_ID"
    echo "enn: lost node(s) $lost: relaunching on $train nodes ($picked${left:+; spare: $left}), relaunch $relaunch" >&2
    step_args=(--overlap --mem=0 "--nodes=$train" "--ntasks-per-node=$((10#$tpn))"
      "--ntasks=$((train * 10#$tpn))" "--nodelist=$picked")
  done
  rm -f -- "$enn_stop_file" "$decision"
  return "$rc"
}
# A lock left by another Slurm job (one cancelled while pending never clears its own) is
# judged by the worker, inside an image that may have no Slurm client: ask here, before srun,
# and pass the answer in as ENN_LOCK_JOB_STATE=JOBID:alive|gone (no answer: nothing set).
enn_lock="$ENN_RUN_DIR/run.lock"
enn_lock_job=""
if [ -f "$enn_lock" ] && [ ! -L "$enn_lock" ]; then
  enn_lock_job=$(timeout 5 head -c 4096 -- "$enn_lock" 2>/dev/null \
    | sed -n 's/.*"slurm_job_id": *"\([0-9_]\{1,24\}\)".*/\1/p' | head -n 1)
fi
if [ -n "$enn_lock_job" ] && [ "$enn_lock_job" != "${SLURM_JOB_ID:-}" ] && command -v squeue >/dev/null; then
  # the job's state as cluster/slurm.py asks it (squeue, machine-readable), first line only
  if enn_lock_says=$(timeout 30 squeue -h -t all -j "$enn_lock_job" -o %T 2>&1); then
    enn_lock_says=${enn_lock_says%%$'\n'*}
    # a job whose own batch shell recorded its end holds nothing while Slurm cleans up
    [ "$enn_lock_says" != COMPLETING ] \
      || ! enn_regular "$ENN_RUN_DIR/@REQUEUE@/@MARK_ENDED@$enn_lock_job" || enn_lock_says=ENDED
    case "$enn_lock_says" in
      @LIVE_STATE_PATTERNS@) export ENN_LOCK_JOB_STATE="$enn_lock_job:alive" ;;
      [A-Z]*) export ENN_LOCK_JOB_STATE="$enn_lock_job:gone" ;;
    esac
  elif case "$enn_lock_says" in *"Invalid job id"*) true ;; *) false ;; esac; then
    export ENN_LOCK_JOB_STATE="$enn_lock_job:gone"  # the controller no longer knows it
  fi
fi
# <<< host
