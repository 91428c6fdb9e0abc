"""Which checkpoint step a command uses, and what it says when it passes over newer ones.

Skipping an incomplete or damaged step is the rule (a commit record is written last; a step
that fails it is never loaded), but never silently: predict, resume and export end with
`fallback_line`, naming the step used and each newer step skipped, and why. predict and
export read every byte of the step they choose (`choose_step`); resume's login node reads
none (`usable_step(read_bytes=False)`), as its workers verify the bytes while loading.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

from enn_cluster.config.inputs import INPUTS
from enn_cluster.errors import UserError
from enn_cluster.storage.checksum import algorithm_of
from enn_cluster.storage.commits import (
    COMMIT,
    committed_steps,
    list_steps,
    loadable_problems,
    read_commit,
    step_dir,
    step_problems,
)


def shape_problems(path: Path) -> list[str]:
    """What can be told about a committed step without reading its data: a readable commit
    record, checksum algorithms this version knows, every file a regular file at its
    recorded size, and metadata that loads. The workers then verify every byte while
    choosing the step."""
    if Path(path).is_symlink():
        return [f"{Path(path).name}: a symbolic link, not a step directory this run wrote"]
    record = read_commit(path)
    if record is None:
        return [f"{COMMIT}: missing or unreadable (incomplete checkpoint)"]
    problems = []
    for name, info in sorted(record["files"].items()):
        try:
            algorithm_of(info.get("checksum"))
            st = (Path(path) / name).lstat()
        except ValueError as exc:
            problems.append(f"{name}: {exc}")
            continue
        except OSError:  # missing, or a name the filesystem refuses
            problems.append(f"{name}: missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{name}: not a regular file (a directory, a link or a device)")
        elif st.st_size != info.get("size"):
            problems.append(f"{name}: size {st.st_size}, recorded {info.get('size')}")
    return problems or loadable_problems(path)


def usable_step(root: Path, step: Optional[int] = None,
                read_bytes: bool = True) -> tuple[Optional[int], dict[int, list[str]]]:
    """`step`, or the newest step directory that can be loaded, and {step passed over: its
    problems}. `read_bytes`: every file checksummed (step_problems); else only what needs
    no data read (shape_problems: resume's login node, whose workers verify the bytes)."""
    check = step_problems if read_bytes else shape_problems
    skipped = {}
    for cand in [step] if step is not None else list_steps(root)[::-1]:
        try:
            problems = check(step_dir(root, cand))
        except UserError as exc:  # commit.json a FIFO, a device, a symlink: the line names it
            problems = [str(exc)]
        if not problems:
            return cand, skipped
        skipped[cand] = problems
    return None, skipped


def fallback_line(used: Optional[int], skipped: dict[int, list[str]]) -> Optional[str]:
    """What predict, resume and export say last when they pass over newer steps (skipping
    an incomplete or damaged step is the rule, but never silently): the step used, and
    each newer step skipped and why. None when none was. Pure."""
    newer = sorted((s for s in skipped if used is not None and s > used), reverse=True)
    if not newer:
        return None
    why = "; ".join(f"step-{s} ({skipped[s][0]})" for s in newer)
    return (f"checkpoint step-{used} used; skipped the newer {why}; `enn-submit verify` "
            "lists every problem")


def choose_step(root: Path, step: Optional[int] = None) -> tuple[int, Optional[str]]:
    """The step predict and export load: `step` (a committed one), or the newest committed
    step that verifies by checksum and whose metadata loads (workers must never start on a
    checkpoint they cannot read); and the `fallback_line` to say last."""
    run = Path(root).parent
    committed = committed_steps(root)
    if not committed:
        refusal = resume_refusal(root)
        raise UserError(refusal) if refusal else UserError(
            "{value} has no complete checkpoint yet", field=INPUTS["run_dir"], value=run,
            fix="train or resume it first")
    if step is not None and step not in committed:
        raise UserError("step-{value} is not a complete checkpoint of {run}",
                        field=INPUTS["step"], value=step, run=run,
                        fix="choose one of {steps}", steps=", ".join(map(str, committed)))
    used, skipped = usable_step(root, step)
    if used is None:
        failed = [s for s in skipped if s in committed]
        first = skipped[failed[0]][0]
        raise UserError("{failed} {fail} verification ({first})", field=INPUTS["step"],
                        value=step, failed=", ".join(f"step-{s}" for s in failed),
                        fail="fails" if len(failed) == 1 else "fail", first=first,
                        fix="see 'enn-submit verify {run}' and choose another {field}", run=run)
    return used, fallback_line(used, skipped)


def resume_refusal(root: Path, point: Optional[tuple] = None) -> Optional[str]:
    """Resume continues from a checkpoint, never silently from scratch: where checkpoint steps
    were committed (a commit.json exists, readable or not) but none can be resumed from, the
    newest one's problem, else None. Steps torn before their commit never counted: a run
    stopped during its first save starts again from scratch, as it should. Only what needs
    no data read is checked here (`point`: usable_step(root, read_bytes=False), where the
    caller has it): the workers verify every byte when they choose the step, and reading a
    large checkpoint twice, once on the login node, would double the start-up I/O."""
    used, skipped = point or usable_step(root, read_bytes=False)
    steps = [s for s in skipped if os.path.lexists(step_dir(root, s) / COMMIT)]
    if used is not None or not steps:
        return None
    newest = max(steps)
    why = "; ".join(skipped[newest][:2])
    return (f"checkpoint step-{newest}: {why}; no checkpoint of this run verifies (resume "
            "would start from scratch, predict has no weights): restore the checkpoint "
            "directory, or start a new run")
