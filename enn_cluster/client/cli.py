"""`enn-submit`: the command line. Parses flags, calls launch/collect/status functions.

Bad input ends with one line on stderr and exit code 2. torch is imported only by the
commands that run workers, so `--help`, `render` and `status` stay fast.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from enn_cluster.client.cli_ops import (
    cmd_cancel,
    cmd_logs,
    cmd_render,
    plan_from_flags,
    say_last,
    site_config,
)
from enn_cluster.client.launching import (
    check_control_files,
    create_train_run,
    launch,
    load_flagged_config,
    removed_if_never_run,
)
from enn_cluster.errors import UserError
from enn_cluster.models import quiet_library_logs


def one_line(text: str) -> str:
    """A message as one line: control characters and line breaks from a path or a value
    (newlines, vertical tabs, NEL, U+2028, terminal escapes) shown as escapes."""
    import unicodedata

    return "".join(ascii(c)[1:-1] if c != "\t" and unicodedata.category(c) in (
        "Cc", "Cf", "Zl", "Zp") else c for c in text)


class _Parser(argparse.ArgumentParser):
    """Bad flags end like every other bad input: one line on stderr, exit code 2."""

    def error(self, message: str):
        import re

        from enn_cluster.errors import did_you_mean

        typo = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if typo:  # a subcommand or a flag's choice
            message += did_you_mean(typo.group(1), re.findall(r"'([^']*)'", typo.group(2)))
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _add_shape_flags(p: argparse.ArgumentParser) -> None:
    """The launch flags (config/launch_options.py): the shape's, then the Slurm ones."""
    from enn_cluster.config.launch_options import OPTIONS

    p.add_argument("--cluster", choices=("local", "slurm"), default="local",
                   help="where workers run: local processes (default) or Slurm via submitit")
    for option in OPTIONS:
        if option.flag and option.shape:
            p.add_argument(option.flag, **option.flag_arguments())
    g = p.add_argument_group("Slurm (with --cluster slurm; the site config fills the rest)")
    for option in OPTIONS:
        if option.flag and not option.shape:
            g.add_argument(option.flag, **option.flag_arguments())
    g.add_argument("--wait", action="store_true", help="block until the Slurm job ends")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="enn-submit", description="Distributed PyTorch training and prediction on "
        "Slurm + Pyxis/Enroot, or locally (the embedded default).")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="make a run directory, stage data, train")
    p.add_argument("--config", required=False, default=None, help="run YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set training.lr=1e-4 (repeatable)")
    p.add_argument("--run-name", default=None, help="shortcut for --set run_name=NAME")
    p.add_argument("--runs-root", default=None, help="shortcut for --set runs_root=DIR")
    _add_shape_flags(p)

    p = sub.add_parser("prepare", help="make a run directory and stage data, without launching "
                       "(for torchrun or a site's own srun line)")
    p.add_argument("--config", required=False, default=None, help="run YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--run-name", default=None, help="shortcut for --set run_name=NAME")
    p.add_argument("--runs-root", default=None, help="shortcut for --set runs_root=DIR")
    _add_shape_flags(p)

    p = sub.add_parser("resume", help="continue a run from its newest complete checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _add_shape_flags(p)

    from enn_cluster.client.cli_predict import register as register_prediction

    register_prediction(sub, _add_shape_flags, COMMANDS)
    from enn_cluster.client.cli_export import register as register_export

    register_export(sub, COMMANDS)
    from enn_cluster.client.cli_plan import register as register_plan

    register_plan(sub, COMMANDS)

    p = sub.add_parser("build", help="build containers/Dockerfile into an Enroot squashfs (cached)")
    p.add_argument("--dockerfile", default="containers/Dockerfile")
    p.add_argument("--context", default=".", help="build context (the repository root)")
    p.add_argument("--cache-dir", default=None, help="image cache (default $ENN_IMAGE_CACHE, "
                   "the site's image_cache, "
                   "or ~/.cache/enn_cluster/images; on a cluster: the shared filesystem)")
    p.add_argument("--build-arg", dest="build_args", action="append", default=[],
                   metavar="KEY=VALUE", help="e.g. BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3")
    p.add_argument("--builder", choices=("podman", "docker"), default=None)
    p.add_argument("--site", default=None, help="site config YAML (its image_cache)")

    p = sub.add_parser("render", help="print the Slurm batch script for a run or config (dry run)")
    p.add_argument("target", help="a run directory or a run YAML")
    p.add_argument("--task", choices=("train", "predict"), default="train")
    p.add_argument("--name", default=None, help="prediction name (--task predict)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--admin", action="store_true",
                   help="print slurm/TASK.sbatch with this run's values filled in (a script "
                   "to keep and submit with sbatch) instead of the script enn-submit submits")
    _add_shape_flags(p)

    p = sub.add_parser("logs", help="a rank's log of the newest attempt")
    p.add_argument("run_dir")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--follow", action="store_true", help="keep printing while the run is live")

    p = sub.add_parser("cancel", help="cancel the run's Slurm job or stop its local launcher")
    p.add_argument("run_dir")

    p = sub.add_parser("verify", help="check every committed checkpoint against its record")
    p.add_argument("run_dir")

    p = sub.add_parser("status", help="last step, checkpoints, jobs of a run")
    p.add_argument("run_dir")
    p.add_argument("--follow", action="store_true",
                   help="a live one-line status until the run's job ends")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between updates")

    p = sub.add_parser("doctor", help="check a run layer by layer: data, model, kernels, "
                       "precision, logs, distributed, checkpoints, export, predictions")
    p.add_argument("run_dir")

    p = sub.add_parser("plot", help="PNG of loss, validation loss, lr and throughput")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    return parser


def _load_train_config(args):
    return load_flagged_config(args.config, args.overrides, args.site, args.run_name,
                               args.runs_root, read_site=lambda: site_config(args))


def cmd_train(args) -> int:
    cfg = _load_train_config(args)
    run, plan = create_train_run(plan_from_flags(args, cfg),
                                 gpu_mem_gb=site_config(args).gpu_mem_gb)
    if plan.slurm is None:
        print(f"run directory: {run.path}", file=sys.stderr)
        return launch(run, plan)
    with removed_if_never_run(run):
        code = launch(run, plan)
    print(f"run directory: {run.path}", file=sys.stderr)
    return code


def cmd_prepare(args) -> int:
    """The run directory an external launcher then starts workers in; the shape given
    here fixes the run's global batch, as a first launch would."""
    import shlex

    from enn_cluster.client.model_shape import check_fits
    from enn_cluster.client.prepare import prepare_run_and_config

    cfg = _load_train_config(args)
    plan = plan_from_flags(args, cfg, machine=False)  # the external launcher places them
    shape = plan.shape
    check_fits(plan.cfg, shape.nodes, shape.gpus_per_node, site_config(args).gpu_mem_gb)
    run, _ = prepare_run_and_config(plan)
    path = shlex.quote(str(run.path))
    print(run.path)
    lo, hi = shape.node_range
    # a range: torchrun's elastic agent, one per node, meeting at a rendezvous (quickstart.md)
    nnodes = f"{lo}:{hi} --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id " \
        f"{shlex.quote(cfg.run_name)}" if hi > lo else str(lo)
    print(f"start every task with: python -m enn_cluster.worker {path} --task train\n"
          f"  e.g. torchrun --nnodes {nnodes} --nproc-per-node {shape.procs_per_node} "
          f"-m enn_cluster.worker {path} --task train", file=sys.stderr)
    return 0


def cmd_resume(args) -> int:
    from enn_cluster.client.prepare import check_model, prepare_resume, resumed_config
    from enn_cluster.storage.rundir import RunDir

    run = RunDir.existing(args.run_dir)
    cfg = run.load_config()
    check_control_files(run)  # before prepare_resume re-freezes the config
    from enn_cluster.storage.step_choice import fallback_line, resume_refusal, usable_step

    point = usable_step(run.checkpoints, read_bytes=False)
    refusal = resume_refusal(run.checkpoints, point)
    if refusal:
        raise UserError(refusal)
    plan = plan_from_flags(args, resumed_config(cfg, args.overrides), run_dir=run.path)
    check_model(plan.cfg)  # the weights folder may have changed since the run began
    prepare_resume(run, cfg, plan)
    code = launch(run, plan)
    say_last(fallback_line(*point))
    return code


def cmd_build(args) -> int:
    from enn_cluster.cluster.image import build_image
    from enn_cluster.cluster.submit_slurm import image_cache_dir

    build_args = {}
    for item in args.build_args:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--build-arg {item!r}: expected KEY=VALUE")
        build_args[key] = value
    for flag, path in (("--dockerfile", args.dockerfile), ("--context", args.context)):
        if not Path(path).exists():
            raise UserError(f"{flag}: {path} does not exist")
    cache = Path(args.cache_dir) if args.cache_dir else \
        image_cache_dir(site_config(args).image_cache)
    image = build_image(args.dockerfile, args.context, cache, build_args=build_args,
                        builder=args.builder)
    print(image)
    return 0


def cmd_verify(args) -> int:
    from enn_cluster.storage import commits as store
    from enn_cluster.storage.rundir import RunDir

    run = RunDir.existing(args.run_dir)
    run.load_config()  # a damaged config.yaml is a damaged run: one line, exit 2
    bad = 0
    steps = store.list_steps(run.checkpoints)
    if not steps:
        print(f"{run.checkpoints}: no checkpoints")
    for step in steps:
        path = store.step_dir(run.checkpoints, step)
        try:
            if store.read_commit(path) is None:
                print(f"step-{step}: incomplete (no commit record), never used for resume")
                continue
            problems = store.verify_checkpoint(path) or store.loadable_problems(path)
        except UserError as exc:  # commit.json is a FIFO, a device, a symlink
            problems = [str(exc)]
        bad += bool(problems)
        print(f"step-{step}: " + ("OK" if not problems else "CORRUPT: " + "; ".join(problems)))
    return 1 if bad else 0


def cmd_status(args) -> int:
    from enn_cluster.client.status import run_status
    from enn_cluster.client.status_text import format_status
    from enn_cluster.storage.rundir import RunDir

    path = RunDir.existing(args.run_dir).path
    RunDir(path).load_config()  # a damaged config.yaml is a damaged run: one line, exit 2
    if args.follow:
        return _follow_status(path, max(args.interval, 0.1))
    # every line may quote run files (metrics.jsonl, run.lock): escape what a terminal obeys
    print("\n".join(one_line(line) for line in format_status(run_status(path)).split("\n")))
    return 0


def _follow_status(path: Path, interval: float) -> int:
    """Redraw one line in place on a terminal; elsewhere print a line when it changes."""
    import time

    from enn_cluster.client.status import run_status
    from enn_cluster.client.status_text import live, progress_line
    from enn_cluster.cluster.slurm_watch import SlurmWatch

    tty, previous, verified = sys.stdout.isatty(), None, {}
    slurm = SlurmWatch(clock=time.monotonic)  # asks Slurm less often as the job lasts
    while True:
        st = run_status(path, verified, slurm)  # a checkpoint's bytes are read once
        line = one_line(progress_line(st))
        if line != previous:
            sys.stdout.write(f"\r\033[K{line}" if tty else line + "\n")
            sys.stdout.flush()
            previous = line
        if not live(st):
            break
        time.sleep(interval)
    if tty:
        sys.stdout.write("\n")
    return 0


def cmd_plot(args) -> int:
    from enn_cluster.client.plot import plot_series, write_plot
    from enn_cluster.storage.metrics import read_metrics
    from enn_cluster.storage.rundir import RunDir

    run = RunDir.existing(args.run_dir)
    run.load_config()
    series = plot_series(read_metrics(run.metrics))
    if not series["loss"][0]:
        raise UserError(f"RUN_DIR: {run.metrics} has no training steps to plot yet")
    from enn_cluster.storage.rundir import run_umask

    if args.out:
        from enn_cluster.storage.output_target import check_local_target, expanded

        args.out = expanded("--out", args.out)
        check_local_target("--out", args.out, overwrite=True, run_dir=run.path,
                           own=("metrics.png",))
    with run_umask():  # 0640 like the rest of the run, whatever the caller's umask
        out = write_plot(series, Path(args.out) if args.out else run.path / "metrics.png",
                         title=run.path.name)
    print(out)
    return 0


COMMANDS = {"train": cmd_train, "prepare": cmd_prepare, "resume": cmd_resume, "verify": cmd_verify,
            "status": cmd_status, "build": cmd_build, "plot": cmd_plot}


COMMANDS.update(render=cmd_render, logs=cmd_logs, cancel=cmd_cancel)


def cmd_doctor(args) -> int:
    from enn_cluster.client.doctor import cmd_doctor as doctor

    return doctor(args)


COMMANDS["doctor"] = cmd_doctor


def main(argv: Optional[list[str]] = None) -> int:
    quiet_library_logs()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"enn-submit: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `enn-submit status RUN | head`: the reader left; so do we
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error as Python flushes stdout
        return 141


if __name__ == "__main__":
    sys.exit(main())
