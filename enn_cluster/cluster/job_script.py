"""A JobSpec as what reaches Slurm, the two ways: `render_batch_script` fills the admin
template (what `enn-submit render` prints and `sbatch FILE` takes) and `submitit_parameters`
feeds submitit. Both launch the same worker command with the same srun and Pyxis flags and
the same host-side requeue snippet, built from the same pieces here. Every value that lands
in a shell line goes through `shlex.quote` (`_q`); the spec refused the rest when it was
made. Pure: no torch, no subprocess.
"""
from __future__ import annotations

import re
import shlex
from importlib import resources
from typing import Optional

from enn_cluster.cluster import pyxis
from enn_cluster.cluster.job_spec import JobSpec
from enn_cluster.cluster.slurm import LIVE_STATES
from enn_cluster.cluster.slurm_values import gpu_option, parse_sbatch_arg
from enn_cluster.config import nccl
from enn_cluster.config.launch_env import MASTER_PORT_BASE, MASTER_PORT_SPAN
from enn_cluster.storage import layout
from enn_cluster.storage.run_lock import run_identity


# -- shared pieces --------------------------------------------------------------------

def _q(value, *, element: bool = False) -> str:
    """shlex.quote, plus quotes where shlex leaves safe text bare but shellcheck objects:
    a leading '=' (`X==a`, SC1097) and commas in an array element (SC2054)."""
    text = shlex.quote(str(value))
    if not text.startswith("'") and (text.startswith("=") or (element and "," in text)):
        text = f"'{text}'"
    return text


# shellcheck flags characters inside single quotes that look like shell (SC2016: '$' and
# '`'; SC1003: '\'; SC2089/SC2090: quotes; SC2088: '~'). Here they are the user's literal text, quoted
# on purpose by shlex.quote, so the line before such a value says so.
_LINT_CODES = (("SC2016", "$`"), ("SC1003", "\\"), ("SC2089,SC2090", "'\""), ("SC2088", "~"))


def _literal(*values) -> list[str]:
    text = "".join(map(str, values))
    codes = [code for code, chars in _LINT_CODES if any(c in text for c in chars)]
    return [f"# shellcheck disable={','.join(codes)}  # literal text, quoted on purpose"] \
        if codes else []


def _template(name: str) -> str:
    return resources.files("enn_cluster.cluster").joinpath("templates", name).read_text("utf-8")


# host_setup.sh's @NAME@ placeholders: the rendezvous port rule of config/launch_env.py,
# which worker/environment.port_for_job applies too (a site's own srun line runs no snippet),
# the Slurm states a lock's job is alive in, and the requeue/ marker names (storage/layout.py).
HOST_SETUP_VALUES = {"MASTER_PORT_BASE": MASTER_PORT_BASE,
                     "MASTER_PORT_BASE_LESS_1": MASTER_PORT_BASE - 1,
                     "MASTER_PORT_LAST": MASTER_PORT_BASE + MASTER_PORT_SPAN - 1,
                     "MASTER_PORT_SPAN": MASTER_PORT_SPAN,
                     "LIVE_STATE_PATTERNS": "|".join(sorted(LIVE_STATES)),
                     **layout.shell_names()}


def host_setup_lines() -> list[str]:
    """The host-side snippet (MASTER_PORT, requeue EXIT trap) both paths share, with its
    placeholders filled from HOST_SETUP_VALUES."""
    text = re.sub(r"@([A-Z][A-Z0-9_]*)@", lambda m: str(HOST_SETUP_VALUES[m.group(1)]),
                  _template("host_setup.sh"))
    return text.splitlines()


def env_lines(spec: JobSpec) -> list[str]:
    """Extra variables (always set), then the profile (the submitter's exported one
    first) and its NCCL defaults, each skipped at run time when the job's environment
    (the submitter's, a module) already has it."""
    lines = [line for k, v in spec.env for line in (*_literal(v), f"export {k}={_q(v)}")]
    # the submitter's exported ENN_NCCL_PROFILE wins; the worker then sets that profile's
    # variables on the node, and this profile's defaults are exported only for this one
    var, profile = nccl.PROFILE_VAR, spec.nccl_profile
    lines.append(f'export {var}="${{{var}:-{profile}}}"')
    defaults = [f'  [ -n "${{{name}+x}}" ] || export {name}={_q(value)}'
                for name, value in nccl.script_env(profile).items()]
    if defaults:
        lines += [f'if [ "${var}" = {profile} ]; then', *defaults, "fi"]
    return lines + cpu_lines(spec)


def cpu_lines(spec: JobSpec) -> list[str]:
    """CPUs per task for srun, which since Slurm 22.05 no longer inherits --cpus-per-task
    from sbatch (it reads SRUN_CPUS_PER_TASK). Default: the node's CPUs in this allocation
    (SLURM_CPUS_ON_NODE) divided by the tasks per node, at least 1."""
    n = spec.tasks_per_node
    value = (str(spec.cpus_per_task) if spec.cpus_per_task else
             f"$(( ${{SLURM_CPUS_ON_NODE:-{n}}} / {n} > 0 ? ${{SLURM_CPUS_ON_NODE:-{n}}} / {n} : 1 ))")
    lines = ["# srun reads SRUN_CPUS_PER_TASK (Slurm >= 22.05 does not pass sbatch's on)",
             f'[ -n "${{SRUN_CPUS_PER_TASK+x}}" ] || export SRUN_CPUS_PER_TASK={value}']
    if allocation(spec)["ntasks-per-node"] is None:  # a range: sbatch's is the whole node's
        lines.append('export SLURM_CPUS_PER_TASK="$SRUN_CPUS_PER_TASK"  # what srun < 22.05 reads')
    return lines


# block: rank r runs on node r // tasks-per-node, as the (replicate, shard) mesh needs (a
# site's SLURM_DISTRIBUTION=cyclic would stretch every shard group across nodes)
SRUN_BASE_FLAGS = ("--kill-on-bad-exit=1", "--distribution=block")


def srun_args(spec: JobSpec) -> list[str]:
    """srun arguments before the interpreter: ours, Pyxis flags, then the user's extras."""
    flags = pyxis.srun_container_flags(spec.container_image, spec.mounts,
                                       spec.container_workdir, spec.env_names)
    return [*SRUN_BASE_FLAGS, *flags, *spec.extra_srun_args]


def srun_shell_lines() -> list[str]:
    """`srun_args` as bash over the admin templates' ENN_* variables: their `srun` block,
    generated from the same flag list (`admin_template` puts it in)."""
    lines = [f"enn_srun_args+=({' '.join(SRUN_BASE_FLAGS)})", 'if [ -n "$ENN_IMAGE" ]; then',
             "  # The run directory is mounted at its own path: the worker reads RUN_DIR inside."]
    for flag, _, value, optional in pyxis.CONTAINER_FLAGS:
        add = f'enn_srun_args+=("{flag}={value}")' if value else f"enn_srun_args+=({flag})"
        lines += [f'  if [ -n "{value}" ]; then', f"    {add}", "  fi"] if optional \
            else [f"  {add}"]
    # bash < 4.4 (RHEL 7): an empty array is "unbound" under set -u unless expanded so
    return lines + ["fi", 'enn_srun_args+=(${enn_srun_extra[@]+"${enn_srun_extra[@]}"})']


def batch_log_lines() -> list[str]:
    """The admin templates' `log` block: #SBATCH cannot name ENN_RUN_DIR, so the batch shell
    moves its own output to layout.batch_log once the run directory is known (`render`
    writes that path in #SBATCH --output instead and leaves the block empty)."""
    log = f'"$ENN_RUN_DIR/{layout.LOGS}/{layout.BATCH_LOG.format(job="$SLURM_JOB_ID")}"'
    name = layout.BATCH_LOG.format(job="JOB_ID")
    return [f"# The batch log is RUN_DIR/{layout.LOGS}/{name} (storage/layout.py), as for every "
            "job of enn-submit;",
            "# only a refusal above lands in sbatch's default slurm-JOB_ID.out.",
            'case "$SLURM_JOB_ID" in',
            "  ''|*[!0-9]*) ;;",
            f'  *) mkdir -p -- "$ENN_RUN_DIR/{layout.LOGS}" && touch -- {log} 2>/dev/null \\',
            f"       && exec >>{log} 2>&1 ;;",
            "esac"]


def admin_template(text: str) -> str:
    """A checked-in admin template with its `log`, `srun` and `host` blocks generated (tests
    hold enn_cluster/cluster/templates/ and slurm/ to this; ENN_UPDATE_GOLDEN=1 rewrites them)."""
    text = replace_block(text, "log", batch_log_lines())
    text = replace_block(text, "srun", srun_shell_lines())
    return replace_block(text, "host", host_setup_lines()[1:-1])  # the snippet's own markers


def worker_command(spec: JobSpec) -> list[str]:
    return [spec.python, *spec.worker_args]


def _mem(spec: JobSpec) -> Optional[str]:
    if spec.mem_gb is None:
        return None
    if spec.mem_gb == 0:
        return "0"
    return f"{int(spec.mem_gb)}G" if spec.mem_gb == int(spec.mem_gb) else f"{int(spec.mem_gb * 1024)}M"


def allocation(spec: JobSpec) -> dict:
    """What sbatch asks of each node, as sbatch option -> value (None: not given). Pure.

    A fixed node count asks for its tasks per node (`--ntasks-per-node`). A range MIN-MAX
    cannot: Slurm fixes a job's task count at submit (MIN x --ntasks-per-node), so such a
    job is never granted more than MIN nodes. A range asks for one task per node holding
    the CPUs of all the node's tasks instead (nothing more to ask with --exclusive), and
    the batch shell's srun splits every granted node into ENN_GPUS_PER_NODE tasks
    (host_setup.sh): the world size is what Slurm granted. Spare nodes are asked the same
    way: the batch shell starts the tasks on all but the spares."""
    if not spec.placed_by_shell:
        return {"ntasks-per-node": spec.tasks_per_node, "cpus-per-task": spec.cpus_per_task}
    if spec.exclusive and spec.cpus_per_task is None:
        return {"ntasks-per-node": None, "cpus-per-task": None}
    return {"ntasks-per-node": None,
            "cpus-per-task": spec.tasks_per_node * (spec.cpus_per_task or 1)}


def range_lines(spec: JobSpec) -> list[str]:
    """The batch shell's variables of a job it places (host_setup.sh): MIN, for the
    relaunch after a lost node and the requeue, the tasks srun starts on every node, and
    the spares it holds out of the step."""
    if not spec.placed_by_shell:
        return []
    lines = [f"ENN_MIN_NODES={spec.node_range[0]}", f"ENN_GPUS_PER_NODE={spec.tasks_per_node}"]
    return lines + ([f"ENN_SPARE_NODES={spec.spare_nodes}"] if spec.spare_nodes else [])


# -- submitit ---------------------------------------------------------------------------

def submitit_parameters(spec: JobSpec) -> dict:
    """Keyword arguments for `AutoExecutor(...).update_parameters(**...)` on Slurm (names
    checked against submitit 1.5.4's `_make_sbatch_string` signature)."""
    lo, hi = spec.allocated_nodes
    # B: the warning goes to the batch shell alone (stop_request.py says why)
    extra: dict = {"requeue": True, "open-mode": "append",
                   "signal": f"B:USR2@{spec.signal_grace_s}"}
    if spec.placed_by_shell:  # a lost node leaves the allocation to the rest (host_setup.sh)
        extra["no-kill"] = True
        if lo != hi:
            extra["nodes"] = f"{lo}-{hi}"
    if spec.mem_gb == 0:
        extra["mem"] = "0"  # submitit would write 0GB
    extra["comment"] = run_identity(spec.run_dir)  # cancel's proof that a job is ours
    # the batch log where every job of ours keeps it, not in submitit's folder
    extra["output"] = extra["error"] = layout.batch_log_pattern(spec.run_dir)
    extra.update(parse_sbatch_arg(a) for a in spec.extra_sbatch_args)
    shape = allocation(spec)
    params = {
        "name": spec.job_name, "nodes": lo,
        **({"tasks_per_node": shape["ntasks-per-node"]} if shape["ntasks-per-node"] else {}),
        "timeout_min": spec.time_minutes, "slurm_signal_delay_s": spec.signal_grace_s,
        "slurm_srun_args": srun_args(spec), "slurm_additional_parameters": extra,
        "slurm_setup": [
            "# enn_cluster: host-side setup (job_script.submitit_parameters)",
            f"ENN_RUN_DIR={_q(spec.run_dir)}", f"ENN_MAX_RESTARTS={spec.max_restarts}",
            *range_lines(spec),  # host_setup.sh: tasks per node, relaunch, requeue
            *spec.setup_lines, *env_lines(spec), *host_setup_lines()],
    }
    gpus = {}
    if spec.gpus_per_node:
        option, value = gpu_option(spec.gpu_request, spec.gpus_per_node)
        gpus = ({"gpus_per_node": spec.gpus_per_node} if option == "gpus-per-node"
                else {"slurm_gres": value})  # submitit wants an int for the former
    optional = {**gpus, "cpus_per_task": shape["cpus-per-task"],
                "mem_gb": spec.mem_gb or None, "slurm_partition": spec.partition,
                "slurm_account": spec.account, "slurm_qos": spec.qos,
                "slurm_exclusive": True if spec.exclusive else None}
    params.update({k: v for k, v in optional.items() if v is not None})
    return params  # wckey: submit_slurm.slurm_executor (None must reach submitit as None)


def submitit_executor_kwargs(spec: JobSpec) -> dict:
    """`AutoExecutor(folder, **...)`: the interpreter srun starts. `python` is a
    constructor argument in submitit 1.5.4, not an update_parameters one; submitit puts it
    in the script unquoted, so it is quoted here."""
    return {"slurm_python": _q(spec.python)}


# -- batch script -----------------------------------------------------------------------

def sbatch_lines(spec: JobSpec) -> list[str]:
    lo, hi = spec.allocated_nodes
    shape = allocation(spec)
    opts = [("job-name", spec.job_name), ("nodes", f"{lo}-{hi}" if lo != hi else lo),
            ("ntasks-per-node", shape["ntasks-per-node"]),
            gpu_option(spec.gpu_request, spec.gpus_per_node) if spec.gpus_per_node
            else ("gpus-per-node", None), ("cpus-per-task", shape["cpus-per-task"]),
            ("mem", _mem(spec)), ("time", spec.time_minutes), ("partition", spec.partition),
            ("account", spec.account), ("qos", spec.qos), ("wckey", spec.wckey),
            ("exclusive", True if spec.exclusive else None), ("requeue", True),
            ("no-kill", True if spec.placed_by_shell else None),
            ("open-mode", "append"), ("signal", f"B:USR2@{spec.signal_grace_s}"),
            ("output", layout.batch_log_pattern(spec.run_dir)),
            *(parse_sbatch_arg(a) for a in spec.extra_sbatch_args)]
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}"
            for k, v in opts if v is not None]


def parameter_lines(spec: JobSpec) -> list[str]:
    """The template's parameter block with this spec's values (same names, fixed)."""
    values = [("ENN_RUN_DIR", spec.run_dir)]
    if spec.task == "predict":
        values.append(("ENN_PREDICT_NAME", spec.predict_name))
    values += [("ENN_IMAGE", spec.container_image or ""),
               ("ENN_MOUNTS", ",".join(str(m) for m in pyxis.parse_mounts(spec.container_mounts))),
               ("ENN_WORKDIR", spec.container_workdir or ""),
               ("ENN_CONTAINER_ENV", ",".join(spec.env_names)), ("ENN_PYTHON", spec.python),
               ("ENN_GPUS_PER_NODE", "" if allocation(spec)["ntasks-per-node"]
                else spec.tasks_per_node), ("ENN_MAX_RESTARTS", spec.max_restarts)]
    if spec.placed_by_shell:  # host_setup.sh: relaunch after a lost node, requeue at MIN
        values.append(("ENN_MIN_NODES", spec.node_range[0]))
    if spec.spare_nodes:
        values.append(("ENN_SPARE_NODES", spec.spare_nodes))
    lines = [line for k, v in values for line in (*_literal(v), f"{k}={_q(v)}")]
    lines.append(f'ENN_NCCL_PROFILE="${{ENN_NCCL_PROFILE:-{spec.nccl_profile}}}"')  # env_lines
    return lines + _literal(*spec.extra_srun_args) + [
        "enn_srun_extra=(" + " ".join(_q(a, element=True) for a in spec.extra_srun_args) + ")"]


def replace_block(text: str, name: str, lines: list[str]) -> str:
    """Replace what lies between '# >>> NAME' and '# <<< NAME' (markers kept)."""
    start = re.search(rf"^# >>> {re.escape(name)}\b.*\n", text, re.M)
    end = re.search(rf"^# <<< {re.escape(name)}\n", text, re.M)
    if not start or not end or end.start() < start.end():
        raise ValueError(f"template has no '{name}' block")
    body = "".join(line + "\n" for line in lines)
    return text[:start.end()] + body + text[end.start():]


def render_batch_script(spec: JobSpec, template: Optional[str] = None) -> str:
    """The exact batch script for `spec` (`enn-submit render`): the admin template with
    its usage, sbatch, parameter, setup and nccl blocks filled in."""
    text = template if template is not None else _template(f"{spec.task}.sbatch")
    usage = [f"# Rendered by enn-submit for job {spec.job_name}: submit it with `sbatch FILE`.",
             "# Values are fixed here; slurm/*.sbatch takes them from ENN_* variables.",
             "# On USR2 the worker checkpoints; the EXIT trap below requeues from the host."]
    for name, lines in (("usage", usage), ("sbatch", sbatch_lines(spec)),
                        ("parameters", parameter_lines(spec)),
                        ("log", []), ("setup", list(spec.setup_lines)),
                        ("nccl", env_lines(spec))):
        text = replace_block(text, name, lines)
    return text
