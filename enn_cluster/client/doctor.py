"""`enn-submit doctor RUN_DIR`: the run's layers in the order trouble travels through them,
one line each (ok / warning / problem) with the command that shows more.

data -> model -> kernels -> precision -> logs -> distributed -> checkpoints -> export ->
predictions (the last two: the result side, export-safety and what predict wrote).
Why this order: a fault in an early layer explains symptoms in the later ones (a corrupt
staged array makes NaN losses makes failed ranks), so the first problem line is the one
to fix first. Each check reads what the run already wrote (manifest, backend reports,
non-finite dumps, exit records, oom.json, metrics, commit records, prediction manifests);
only the model and export layers import torch. Exit 0 when no layer has a problem, 1
otherwise.
"""
from __future__ import annotations

import json
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from enn_cluster.client.status import newest_slurm_job, save_grace_line
from enn_cluster.errors import UserError
from enn_cluster.storage import backend_report, node_loss
from enn_cluster.storage import commits as store
from enn_cluster.storage import oom_record
from enn_cluster.storage import prediction_manifest as pm
from enn_cluster.storage.attempts import attempt_dirs
from enn_cluster.storage.checksum import RunningChecksum, algorithm_of
from enn_cluster.storage.metrics import read_metrics
from enn_cluster.storage.prediction_collapse import recorded_verdict
from enn_cluster.storage.rundir import RunDir
from enn_cluster.storage.run_files import open_run_file, read_run_text

LEVELS = ("ok", "warning", "problem")
EXIT_CODES_OK = (0, 75)  # done, or stopped with a checkpoint for a requeue


@dataclass(frozen=True)
class Finding:
    layer: str
    level: str  # ok | warning | problem
    detail: str
    more: str  # the command that shows more


def format_finding(f: Finding) -> str:
    return f"{f.layer:<12} {f.level:<8} {f.detail}  (more: {f.more})"


def staged_array_problem(data_dir: Path, entry: dict) -> Optional[str]:
    """A staged .npy against its manifest entry (the checksum covers the data bytes only)."""
    from enn_cluster.storage.npy_header import read_npy_header

    try:
        running = RunningChecksum(algorithm_of(entry["checksum"]))
        with open_run_file(data_dir / entry["file"]) as fh:
            read_npy_header(fh)
            for block in iter(lambda: fh.read(1 << 22), b""):
                running.update(block)
    except FileNotFoundError:
        return f"{entry['file']} is missing"
    except (OSError, ValueError, UserError) as exc:
        return f"{entry['file']} is unreadable ({exc})"
    if running.size != entry["nbytes"] or running.hexdigest() != entry["checksum"]:
        return f"{entry['file']} does not match its manifest checksum (changed after staging)"
    return None


def check_data(run: RunDir, q: str) -> tuple[Finding, Optional[dict]]:
    more = f"cat {q}/data/manifest.json"
    try:
        manifest = json.loads(read_run_text(run.data_dir / "manifest.json"))
    except FileNotFoundError:
        return Finding("data", "problem", "data/manifest.json is missing: the staged data "
                       "cannot be trusted; stage again with a new run", f"ls -l {q}/data"), None
    except (ValueError, RecursionError, UserError) as exc:
        return Finding("data", "problem", f"data/manifest.json is unreadable ({exc})", more), None
    bad = [p for _, entry in sorted(manifest.get("entries", {}).items())
           for p in [staged_array_problem(run.data_dir, entry)] if p]
    if bad:
        return Finding("data", "problem", "; ".join(bad), more), manifest
    return Finding("data", "ok", f"{len(manifest.get('entries', {}))} staged arrays match "
                   "their checksums", more), manifest


def check_model(run: RunDir, cfg, manifest: Optional[dict]):
    """(finding, model built with fresh weights or None, input shape). A model whose base
    weights are files of their own (a causal LM's) is built on the meta device: the
    workers are what read those."""
    import torch

    from enn_cluster.models import kind_of, output_size

    more = f"python -c {shlex.quote('import ' + cfg.model.name.split(':')[0])}" \
        if ":" in cfg.model.name else f"grep -A5 '^model:' {shlex.quote(str(run.config_path))}"
    if manifest is None:
        return Finding("model", "warning", "not checked: no data manifest gives the input "
                       "shape", more), None, None
    shape, weights = tuple(manifest["entries"]["train_x"]["shape"][1:]), None
    try:
        kind = kind_of(cfg)
        kind.check(cfg)
        weights = kind.weights_dir(cfg)
        if weights is not None:
            more = f"ls -l {shlex.quote(str(weights))}"
            with torch.device("meta"):
                model = kind.build(cfg, shape, output_size(cfg, manifest))
        else:
            model = kind.build(cfg, shape, output_size(cfg, manifest))
    except UserError as exc:
        return Finding("model", "problem", str(exc), more), None, shape
    except Exception as exc:  # the user's factory or transformers raised: never crash doctor
        return Finding("model", "problem", f"model.name: {cfg.model.name} does not build "
                       f"({type(exc).__name__}: {str(exc)[:200]})", more), None, shape
    return Finding("model", "ok", kind.describe(cfg, model, shape), more), \
        (None if weights is not None else model), shape


def _warnings(reports: list[dict], layer: str) -> list[str]:
    """The backend reports' warnings for one layer, once each (ranks mostly agree)."""
    return sorted({w for r in reports for w in backend_report.layer_warnings(r)[layer]})


def check_kernels(reports: list[dict], attempt: Optional[str], q: str) -> Finding:
    more = f"enn-submit status {q}"
    if not reports:
        return Finding("kernels", "warning", "no backend report (no attempt has started, or "
                       "the run predates backend reports)", more)
    first = reports[0]
    sdpa = "+".join(k for k, on in sorted(first.get("sdpa", {}).items()) if on) or "none"
    detail = (f"attempt {attempt}: {first.get('device_type')} ({first.get('device_name')}), "
              f"torch {first.get('torch')}, SDPA {sdpa}, "
              f"compile {'on' if first.get('compile') else 'off'}")
    warnings = _warnings(reports, "kernels")
    if warnings:
        return Finding("kernels", "warning", "; ".join([detail, *warnings]), more)
    return Finding("kernels", "ok", detail, more)


def _non_finite(value) -> bool:
    return isinstance(value, str) or (isinstance(value, float) and not math.isfinite(value))


def check_precision(run: RunDir, reports: list[dict], q: str) -> Finding:
    from enn_cluster.client.status import nonfinite_dumps
    from enn_cluster.client.status_text import nonfinite_line

    more = f"grep '\"kind\": \"train\"' {q}/metrics.jsonl | tail -n 5"
    train = list(read_metrics(run.metrics, "train"))
    bf16 = [r for r in reports if r.get("bf16")]
    if _warnings(reports, "precision"):
        return Finding("precision", "problem", "training.bf16 is on but the device has no "
                       "bf16 support; set training.bf16: false", more)
    dump = nonfinite_dumps(run.path / "nonfinite")
    newest = f"; {nonfinite_line(dump)}" if dump else ""
    if dump:  # the dump names the rows, parameters, dtype, lr and gradient norm
        more = f"python -m json.tool {q}/nonfinite/step-{dump['step']}.json"
    if train and _non_finite(train[-1].get("loss")):
        return Finding("precision", "problem", f"the last loss (step {train[-1]['step']}) is "
                       f"{train[-1]['loss']}{newest}", more)
    skipped = max((int(r.get("skipped") or 0) for r in train), default=0)
    mode = "bf16 mixed precision" if bf16 else "fp32"
    if skipped:
        return Finding("precision", "warning", f"{mode}; {skipped} step(s) skipped for a "
                       f"non-finite loss or gradient{newest}", more)
    return Finding("precision", "ok", f"{mode}; {len(train)} logged steps, all finite", more)


def _attempt_findings(log_dir: Path, newest: bool, live: bool) -> tuple[str, list[str]]:
    """(level, notes) for one attempt's rank logs and exit records."""
    ranks = sorted(int(p.stem.rsplit("-", 1)[1]) for p in log_dir.glob("rank-*.log"))
    notes, level = [], "ok"
    for rank in ranks:
        try:
            code = json.loads(read_run_text(log_dir / f"exit-rank-{rank}.json"))["code"]
        except (FileNotFoundError, ValueError, KeyError, TypeError, RecursionError, UserError):
            if newest and live:
                continue
            code = None
        if code in EXIT_CODES_OK:
            continue
        notes.append(f"rank {rank} " + ("left no exit record (killed?)" if code is None
                                        else f"exited {code}"))
        level = "problem" if newest else "warning"  # an older attempt was restarted
    return level, notes


def _newest_job(run: RunDir) -> Optional[str]:
    try:
        return newest_slurm_job(run.jobs())
    except UserError:  # damaged jobs.jsonl: the files check names it
        return None


def _newest_refusal(run: RunDir) -> Optional[str]:
    """The refusal note of the run's newest Slurm job, as one line, or None."""
    job = _newest_job(run)
    note = node_loss.read_refusal(run.path, job) if job is not None else None
    return f"job {job} refused its input (not requeued): {note}" if note else None


def stopped_short(run: RunDir, q: str) -> Optional[str]:
    """Why a run nothing runs now is not done: its last logged step is short of the
    schedule's (a pause, a cancel, a launcher that died or gave up: torchrun's agent after
    a failed join, whose ranks all ended cleanly). None when it finished or never trained."""
    newest = {r.get("kind"): r for r in read_metrics(run.metrics)}  # one read, the last of each
    total = newest.get("start", {}).get("total_steps")
    last = newest.get("train", {}).get("step")
    if not isinstance(total, int) or not isinstance(last, int) or last >= total:
        return None
    return (f"stopped at step {last} of {total} and nothing runs it: enn-submit resume {q} "
            "goes on from its newest complete checkpoint")


def check_logs(run: RunDir, live: bool, q: str) -> Finding:
    dirs = attempt_dirs(run)
    refusal = _newest_refusal(run) if not live else None
    job = _newest_job(run) if live else None  # a lost node's relaunch: ranks exited, job lives
    relaunch = job and node_loss.relaunch_under_way(run.path, job, dirs[-1].name if dirs else None)
    if refusal and not dirs:  # refused before any rank wrote a log (version skew)
        return Finding("logs", "problem", refusal, f"enn-submit status {q}")
    if not dirs:
        return Finding("logs", "warning", "no worker logs: the run never started",
                       f"enn-submit status {q}")
    worst, lines, rank = "ok", [], 0
    for i, d in enumerate(dirs):
        level, notes = _attempt_findings(d, i == len(dirs) - 1 and not relaunch, live)
        if notes:
            lines.append(f"{d.name}: {', '.join(notes)}")
            rank = int(notes[0].split()[1])
            worst = max(worst, level, key=LEVELS.index)
    more = f"enn-submit logs {q} --rank {rank}"
    oom = oom_record.read_record(run.path)
    if oom and oom.get("events"):  # why a rank left: the governor's record and figures
        lines.append(oom_record.summary(oom))
        level = "problem" if oom_record.floor_event(oom) else "warning"
        worst = max(worst, level, key=LEVELS.index)
        more = f"python -m json.tool {q}/{oom_record.NAME}"
    losses = [f"node {','.join(r.get('lost') or ['?'])} lost (job {r.get('job_id')}): went on "
              f"with {len(r.get('nodes') or [])} node(s) from step {r.get('step')}"
              for r in read_metrics(run.metrics, "node_lost")]  # why an attempt's ranks died
    if losses:
        lines += losses
        worst = max(worst, "warning", key=LEVELS.index)
    if relaunch:  # the ranks' exits above are what the relaunch answers
        lines.insert(0, relaunch)
        worst = max(worst, "warning", key=LEVELS.index)
    stopped = None if live else stopped_short(run, q)
    if stopped:  # every rank may have ended cleanly, and the run is still not done
        lines.append(stopped)
        worst = max(worst, "warning", key=LEVELS.index)
    if refusal:  # why the job stopped comes first, whatever its ranks' logs say after it
        lines.insert(0, refusal)
        worst, more = "problem", f"enn-submit status {q}"
    detail = "; ".join(lines) if lines else f"{len(dirs)} attempt(s), every rank ended cleanly"
    return Finding("logs", worst, detail, more)


def check_distributed(reports: list[dict], attempt: Optional[str], q: str) -> Finding:
    more = f"cat {q}/logs/{shlex.quote(attempt or 'ATTEMPT')}/backend-rank-0.json"
    if not reports:
        return Finding("distributed", "warning", "no backend report to read the lanes from", more)
    warnings = _warnings(reports, "distributed")
    lanes = ", ".join(f"{k} {v}" for k, v in sorted(reports[0].get("lanes", {}).items()))
    nccl = reports[0].get("nccl_transport")
    detail = f"{len(reports)} rank(s); lanes: {lanes}" + (f"; NCCL over {nccl}" if nccl else "")
    if warnings:
        return Finding("distributed", "warning", f"{detail}; {warnings[0]}", more)
    return Finding("distributed", "ok", detail, more)


def _step_damage(path: Path) -> Optional[str]:
    """The first problem of a step that has a commit record, or None. A live run's keep-k
    prune removes a step's commit.json first (commits.prune): a step whose record is gone
    by the time its problem is found was pruned while doctor read it, which is no damage."""
    problems = store.verify_checkpoint(path) or store.loadable_problems(path)
    if problems and not os.path.lexists(path / store.COMMIT):
        return None
    return problems[0] if problems else None


def check_checkpoints(run: RunDir, q: str) -> Finding:
    more = f"enn-submit verify {q}"
    recorded = [s for s in store.list_steps(run.checkpoints)
                if os.path.lexists(store.step_dir(run.checkpoints, s) / store.COMMIT)]
    if not recorded:
        return Finding("checkpoints", "warning", "no complete checkpoint", more)
    bad = []
    for step in recorded:  # a commit record whose files no longer match it is damage
        problem = _step_damage(store.step_dir(run.checkpoints, step))
        if problem:
            bad.append(f"step-{step}: {problem}")
    if bad:
        return Finding("checkpoints", "problem", "; ".join(bad), more)
    committed = store.committed_steps(run.checkpoints)  # after the reads: pruned ones gone
    if not committed:
        return Finding("checkpoints", "warning", "no complete checkpoint", more)
    try:
        jobs = run.jobs()
    except UserError:  # damaged jobs.jsonl: the files check names it
        jobs = []
    slow = save_grace_line(run, jobs)
    return Finding("checkpoints", "warning" if slow else "ok", f"{len(committed)} complete, "
                   f"all verify (newest step-{committed[-1]})" + (f"; {slow}" if slow else ""),
                   more)


def check_export(model, shape, cfg, q: str) -> Finding:
    from enn_cluster.models import kind_of

    name, more = cfg.model.name, f"enn-submit export {q} --out DIR --format export"
    try:
        formats = kind_of(cfg).export_formats
    except UserError:  # its module does not import: the model finding says so
        formats = ()
    if formats:  # a kind's own formats (a causal LM's Hugging Face ones) come first
        return Finding("export", "ok", f"exports as --format {' or '.join(formats)}",
                       f"enn-submit export {q} --out DIR --format {formats[0]}")
    if model is None:
        return Finding("export", "warning", "not checked: the model does not build", more)
    from enn_cluster.client.artifact_export import export_problem

    problem = export_problem(model, shape, name)
    if problem:
        return Finding("export", "warning", problem, more)
    return Finding("export", "ok", "torch.export traces the forward (dynamic batch)", more)


def _chunk_damage(pdir: Path, manifest) -> Optional[str]:
    """What collect would refuse in a committed prediction: a manifest that is not one, a
    chunk of object dtype, a chunk that is not a regular file (never opened: a FIFO would
    hang), or bytes that do not match their record (truncated, rewritten)."""
    import stat

    import numpy as np

    from enn_cluster.client.collect import manifest_problem

    problem = manifest_problem(manifest)
    if problem:
        return problem
    for rec in manifest["chunks"]:
        try:
            if np.dtype(rec.get("dtype", "<f4")).hasobject:
                return f"{rec['file']}: dtype {rec.get('dtype')!r} holds Python objects"
        except TypeError:
            return f"{rec['file']}: dtype {str(rec.get('dtype'))[:40]!r} is not a dtype"
        try:
            regular = stat.S_ISREG(os.lstat(pdir / rec["file"]).st_mode)
        except OSError:
            regular = False
        if not regular:
            return f"{rec['file']}: missing or not a regular file"
    try:
        problems = pm.verify_chunks(pdir, manifest)
    except (KeyError, TypeError):
        return "a chunk record lacks its size or checksum"
    return "; ".join(problems[:2]) if problems else None


def _prediction_finding(run: RunDir, name: str) -> Optional[tuple[str, str, str]]:
    """(level, detail, more) for one committed prediction, or None when it looks sound."""
    path = run.predictions / name / pm.MANIFEST
    try:
        manifest = json.loads(read_run_text(path))
    except (OSError, ValueError, RecursionError, UserError) as exc:
        return "problem", f"{name}: {pm.MANIFEST} is unreadable ({exc}); predict again " \
            "with another --name", f"ls -l {shlex.quote(str(path.parent))}"
    damage = _chunk_damage(path.parent, manifest)
    if damage:
        return "problem", f"{name}: {damage}; predict again with another --name", \
            f"enn-submit collect {shlex.quote(str(run.path))} --name {shlex.quote(name)} --out OUT.npy"
    verdict = recorded_verdict(manifest.get("collapse") if isinstance(manifest, dict) else None)
    if verdict:
        return "warning", f"{name}: collapse verdict ({verdict['verdict']}): " \
            f"{verdict['message']}", f"python -m json.tool {shlex.quote(str(path))}"
    return None


def check_predictions(run: RunDir, q: str) -> Finding:
    """The result side: each committed prediction's near-constant verdict (the workers
    compared raw, denormalised, fp32 re-run and per-sample candidates, prediction_collapse)."""
    names = sorted(p.parent.name for p in run.predictions.glob(f"*/{pm.MANIFEST}"))
    if not names:
        return Finding("predictions", "ok", "no committed prediction", f"ls {q}/predictions")
    found = [f for name in names for f in [_prediction_finding(run, name)] if f]
    if found:
        worst = max((f[0] for f in found), key=LEVELS.index)
        first = next(f for f in found if f[0] == worst)
        return Finding("predictions", worst, "; ".join(f[1] for f in found), first[2])
    return Finding("predictions", "ok", f"{len(names)} committed prediction(s), none "
                   "near-constant", f"enn-submit collect {q} --name "
                   f"{shlex.quote(names[-1])} --out OUT.npy")


def check_run_files(run: RunDir, q: str) -> Finding:
    """The control files other commands refuse when damaged: doctor says so too (binary
    metrics, a jobs.jsonl or request.json that is not JSON; a lock that does not parse is
    refused before any finding, as every command refuses it)."""
    from enn_cluster.storage.metrics import scan_metrics

    problems = []
    _, unreadable = scan_metrics(run.metrics)
    if unreadable:
        problems.append(f"{run.metrics.name}: {unreadable} line(s) are not JSON records "
                        "(damaged or binary)")
    try:
        run.jobs()
    except UserError as exc:
        problems.append(str(exc).split(";")[0])
    for request in sorted(run.predictions.glob(f"*/{pm.REQUEST}")):
        try:
            ok = isinstance(json.loads(request.read_text(encoding="utf-8")), dict)
        except (OSError, ValueError):
            ok = False
        if not ok:
            problems.append(f"predictions/{request.parent.name}/{pm.REQUEST} is not a JSON "
                            "object; predict again with another --name")
    if problems:
        return Finding("files", "problem", "; ".join(problems), f"ls -la {q}")
    return Finding("files", "ok", "metrics, jobs and prediction requests parse", f"ls -la {q}")


def diagnose(path: Path) -> list[Finding]:
    """Every layer's finding, in order."""
    from enn_cluster.client.status import live_lock

    run = RunDir.existing(path)
    cfg, q = run.load_config(), shlex.quote(str(run.path))
    attempt, reports = backend_report.newest_reports(attempt_dirs(run))
    data, manifest = check_data(run, q)
    model_finding, model, shape = check_model(run, cfg, manifest)
    return [check_run_files(run, q), data, model_finding, check_kernels(reports, attempt, q),
            check_precision(run, reports, q), check_logs(run, live_lock(run) is not None, q),
            check_distributed(reports, attempt, q), check_checkpoints(run, q),
            check_export(model, shape, cfg, q), check_predictions(run, q)]


def cmd_doctor(args) -> int:
    findings = diagnose(Path(args.run_dir))
    for f in findings:
        print(format_finding(f), flush=True)
    return 1 if any(f.level == "problem" for f in findings) else 0
