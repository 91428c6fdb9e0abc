"""A run's status dict (status.run_status) in words: `enn-submit status`, the one-line view
of `status --follow`, and the lines doctor shares. Pure: no file is read here."""
from __future__ import annotations

import shlex
import time
from typing import Optional

from enn_cluster.storage import oom_record


def nonfinite_line(nf: dict) -> str:
    """The newest non-finite dump in one line (status, doctor)."""
    rec = nf["record"]
    rows = rec.get("rows") if isinstance(rec.get("rows"), list) else []
    shards = rec.get("nonfinite_grad_shards")
    grads = ", ".join(f"{k} ({v} shard{'s' if v != 1 else ''})"
                      for k, v in (shards.items() if isinstance(shards, dict) else ()))
    return (f"{nf['count']} dump(s); newest nonfinite/step-{nf['step']}.json: rows "
            f"{rows[:8]}{' ...' if len(rows) > 8 else ''}; non-finite grads: {grads or 'none'}"
            f"; loss {rec.get('loss')}, lr {rec.get('lr')}")


def world_sizes_line(jobs: list[dict]) -> Optional[str]:
    """'4 (torchrun 12:01:05) -> 2 (torchrun 12:04:10)': the world size of each launch where
    it changed. An external launcher's membership change (torchrun's agents restarting the
    workers on the nodes left) shows nowhere else; None while it never changed."""
    sized = []
    for j in jobs:
        world = j.get("world_size")
        if world is None and isinstance(j.get("nodes"), int) and j.get("tasks_per_node"):
            world = j["nodes"] * j["tasks_per_node"]
        if isinstance(world, int) and (not sized or sized[-1][0] != world):
            sized.append((world, j.get("kind"), j.get("time")))
    if len(sized) < 2:
        return None
    return " -> ".join(f"{w} ({kind} {time.strftime('%H:%M:%S', time.localtime(t))})"
                       if isinstance(t, (int, float)) else f"{w} ({kind})" for w, kind, t in sized)


def format_status(st: dict) -> str:
    lines = [f"run:             {st['run_dir']}",
             f"last step:       {st['last_step']} (loss {st['last_loss']})",
             f"last eval loss:  {st['last_eval_loss']}",
             f"checkpoints:     {', '.join(f'step-{s}' for s in st['checkpoints']) or 'none'}",
             f"last complete:   {('step-%s' % st['last_checkpoint']) if st['last_checkpoint'] is not None else 'none'}"
             + (" (checksums verified)" if st["last_checkpoint"] is not None else ""),
             *(f"{'corrupt:' if i == 0 else '':<17}step-{step}: {problems[0]} "
               f"(resume skips it; `enn-submit verify` lists every problem)"
               for i, (step, problems) in enumerate(sorted(st["corrupt_checkpoints"].items()))),
             f"restarts:        {st['resumes']} resume(s), {len(st['jobs'])} launch(es)"]
    if world_sizes_line(st["jobs"]):
        lines.append(f"world size:      {world_sizes_line(st['jobs'])}")
    for i, line in enumerate((st.get("backends") or {}).get("lines", [])):
        lines.append(f"{'backends:' if i == 0 else '':<17}{line}")
    if st.get("oom") and st["oom"].get("events"):
        lines.append(f"memory:          {oom_record.summary(st['oom'])}")
    if st.get("save_over_grace"):
        lines.append(f"warning:         {st['save_over_grace']}")
    if st.get("nonfinite"):
        lines.append(f"non-finite:      {nonfinite_line(st['nonfinite'])}")
    if st.get("slurm"):
        lines += slurm_lines(st["slurm"])
        lines += pending_fix_lines(st)
    lines += node_loss_lines(st)
    if st["lock"]:
        owner = st["lock"]
        # a Slurm job's lock is written by the submitter for the job (pid 0 on "slurm"): the
        # job is the holder, and where it stands is the run's last step
        who = (f"Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id")
               else f"pid {owner.get('pid')} on {owner.get('host')}")
        lines.append(f"in use by:       {who}"
                     + (" (starting: no step of this launch yet)" if st.get("starting") else
                        f" (at step {st['last_step']})" if st.get("last_step") is not None
                        else ""))
    return "\n".join(lines)


def slurm_lines(s: dict) -> list[str]:
    """The job's state, and what Slurm is doing with it when that is not plain."""
    from enn_cluster.cluster.slurm import held_until, pending_why
    from enn_cluster.cluster.slurm_watch import node_hint

    lines = [f"slurm job:       {s.get('job_id')} {s.get('state')} "
             f"(restarts {s.get('restarts', 0)})"]
    if held_until(s):
        lines.append(f"held:            {held_until(s)}")
    if pending_why(s):
        lines.append(f"pending:         {pending_why(s)}")
    if node_hint(s):
        lines.append(f"node down:       {node_hint(s)}")
    return lines


def pending_fix_lines(st: dict) -> list[str]:
    """What to run for a pending job that waits for nodes Slurm has down, or that Slurm
    will never start as asked; nothing for one that merely waits its turn."""
    from enn_cluster.cluster.slurm import NODES_UNAVAILABLE, never_starts

    s, run = st["slurm"], shlex.quote(st["run_dir"])
    if s.get("state") != "PENDING":
        return []
    if never_starts(s):
        return [f"to run:          enn-submit cancel {run}, then enn-submit resume {run} with "
                "fewer --nodes or GPUs, less --time, or another --partition"]
    if (s.get("reason") or "").startswith(NODES_UNAVAILABLE):
        count = s.get("node_count") or 0
        fewer = f" --nodes {count - 1}" if count > 1 else " --partition OTHER"
        return [f"to go on:        wait for the node, or without it: enn-submit cancel {run}, "
                f"then enn-submit resume {run}{fewer}"]
    return []


def node_loss_lines(st: dict) -> list[str]:
    """Nodes lost inside the allocation and where the run went on; a probe or a relaunch
    under way."""
    lines = [f"{'node lost:' if i == 0 else '':<17}{','.join(r.get('lost') or ['?'])} "
             f"{loss_time(r)} (job {r.get('job_id')}): went on with "
             f"{len(r.get('nodes') or [])} node(s), world {r.get('world_size')}, "
             f"from step {r.get('step')}{spare_words(r)}"
             for i, r in enumerate(st.get("node_losses") or [])]
    if st.get("relaunch") and live(st):
        lines.append(relaunch_line(st["relaunch"], st.get("last_checkpoint")))
    if st.get("probing_since") and live(st):
        lines.append(f"probing:         since {_clock(st['probing_since'])} the job's ranks "
                     "on its first node have ended: asking which nodes still answer")
    if st.get("refused") and not st.get("lock"):
        job = (st.get("slurm") or {}).get("job_id", "?")
        lines.append(f"refused:         job {job} refused its input and was not requeued: "
                     f"{st['refused']}; fix that, then enn-submit resume "
                     f"{shlex.quote(st['run_dir'])}")
    ended = st.get("ended") or {}
    if ended.get("lost") and not st.get("lock"):
        answered = len(ended["nodes"])
        job = (st.get("slurm") or {}).get("job_id", "?")
        lines.append(f"stopped:         job {job} lost {','.join(ended['lost'])} at "
                     f"{_clock(ended['time'])}: {answered} node(s) answered, fewer than its "
                     f"minimum {ended['min']}; the run is free (Slurm may show the job "
                     "COMPLETING until it declares the node down): continue with "
                     f"enn-submit resume {shlex.quote(st['run_dir'])} "
                     f"--nodes {max(answered, 1)}")
    return lines


def loss_time(r: dict) -> str:
    """When a node was lost, as the records bound it: after the last step logged with it,
    before the ranks on the job's first node ended; and when the probe confirmed it."""
    ended, hms = "the ranks on the first node had ended", "%H:%M:%S"
    if r.get("last_step") is None:
        lost = f"by {_clock(r.get('ended'))} ({ended})"
    else:
        lost = (f"between {_clock(r.get('last_step_time'))} (after step {r['last_step']}, its "
                f"last logged) and {_clock(r.get('ended'), hms)} ({ended})")
    return f"{lost}, detected {_clock(r.get('detected'), hms)}"


def spare_words(r: dict) -> str:
    """What spare nodes did in a relaunch: which took a lost node's place, how many are
    left ("" for a job without spares)."""
    taken, left = r.get("spare_in") or [], r.get("spares") or []
    words = (f"; spare {','.join(taken)} in place of {','.join(r.get('lost') or ['?'])}"
             if taken else "")
    return words + (f"; {len(left)} spare(s) still held" if left else "")


def relaunch_line(rec: dict, checkpoint: Optional[int]) -> str:
    """A relaunch whose new ranks have not resumed yet (node_loss.relaunch_pending): where,
    at what world size, from which step (the newest complete checkpoint, which they load)."""
    world = f"world {rec['world']}, " if rec.get("world") else ""
    start = f"from step {checkpoint}" if checkpoint is not None else "from the first step"
    return (f"relaunching:     on {','.join(rec['nodes'])} ({world}{start}{spare_words(rec)}): "
            f"job {rec['job_id']} lost {','.join(rec['lost'])} {loss_time(rec)}; relaunch "
            f"{rec['relaunch']} launched "
            f"at {_clock(rec['launched'], '%H:%M:%S')}, its ranks are starting")


def _clock(epoch, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return time.strftime(fmt, time.localtime(epoch)) \
        if isinstance(epoch, (int, float)) else "?"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _num(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)  # "nan" strings


def slurm_part(s: dict) -> str:
    """'slurm RUNNING', 'slurm PENDING (held until 2026-11-25 22:44:51)', 'slurm RUNNING,
    node n2 not answering': the Slurm part of the live line."""
    from enn_cluster.cluster.slurm import held_until

    text = f"slurm {s.get('state')}"
    if held_until(s):
        when = (s.get("start_time") or "").replace("T", " ")
        text += f" (held until {when})" if " until " in held_until(s) else " (held)"
    return text + "".join(f", node {n} not answering" for n in sorted(s.get("dead_nodes") or {}))


def live(st: dict) -> bool:
    """Is something still going to happen to this run (a live lock or a live Slurm job)?"""
    if st["lock"]:
        return True
    from enn_cluster.cluster.slurm import LIVE_STATES

    return bool(st.get("slurm")) and st["slurm"].get("state") in LIVE_STATES


def progress_line(st: dict) -> str:
    """The one-line live view of `enn-submit status --follow`."""
    step, total = st["last_step"], st.get("total_steps")
    parts = [f"step {step if step is not None else '-'}" + (f"/{total}" if total else "")]
    if step is not None and total:
        parts[0] += f" ({100.0 * step / total:.0f}%)"
    if st["last_loss"] is not None:
        parts.append(f"loss {_num(st['last_loss'])}")
    if st["last_eval_loss"] is not None:
        parts.append(f"eval {_num(st['last_eval_loss'])}")
    if st.get("samples_per_s"):
        parts.append(f"{st['samples_per_s']:.0f} samples/s")
    if step is not None and total and st.get("step_time_s") and st["lock"] \
            and not st.get("starting"):
        parts.append(f"ETA {_duration((total - step) * st['step_time_s'])}")
    last = st["last_checkpoint"]
    parts.append(f"ckpt {'step-%d' % last if last is not None else 'none'}")
    if st.get("slurm"):
        parts.append(slurm_part(st["slurm"]))
    if st.get("relaunch") and live(st):
        parts.append(f"relaunching on {','.join(st['relaunch']['nodes'])}")
    if st.get("starting"):
        parts.append(f"starting (launcher pid {st['lock'].get('pid')}, no step of this launch yet)")
    else:
        parts.append("running" if st["lock"] else "not running")
    return " | ".join(parts)
