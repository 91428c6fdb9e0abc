"""`enn-submit predict` and `enn-submit collect`.

predict: choose the checkpoint, stage the input, launch the workers (locally or on Slurm,
same flags as train). collect: verify the committed chunks and assemble them in order.
"""
from __future__ import annotations

import shlex
import sys

from enn_cluster.errors import UserError


def register(sub, add_shape_flags, commands) -> None:
    """Add the prediction subcommands to the parser and their handlers to `commands`."""
    p = sub.add_parser("predict", help="predict with a checkpoint: chunks + manifest in the run")
    p.add_argument("run_dir")
    p.add_argument("--input", default=None,
                   help=".npy/.npz path or fsspec URL (not needed to continue NAME)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--name", default=None,
                   help="prediction name (default: INPUT-step-N); an existing one continues")
    p.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk file")
    p.add_argument("--batch-size", type=int, default=None, help="rows per forward pass")
    p.add_argument("--generate", type=int, default=None, metavar="N",
                   help="causal LM: continue each row by up to N tokens (default: score rows)")
    p.add_argument("--seed", type=int, default=None,
                   help="with --generate: sample with this seed (default: greedy)")
    p.add_argument("--sharded", action="store_true",
                   help="causal LM: predict with the model sharded over the ranks (the "
                        "default when one GPU cannot hold it) instead of a replica per rank")
    p.add_argument("--prepare-only", action="store_true",
                   help="stage the prediction and stop: no workers, no job (for "
                        "slurm/predict.sbatch submitted by hand)")
    add_shape_flags(p)

    p = sub.add_parser("collect", help="verify a prediction and assemble it in input order")
    p.add_argument("run_dir")
    p.add_argument("--name", default=None, help="prediction name (default: the only one)")
    p.add_argument("--out", required=True, help=".npy path or fsspec URL to write")
    p.add_argument("--raw", action="store_true",
                   help="model outputs as they are (no target de-normalisation)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    commands.update(predict=cmd_predict, collect=cmd_collect)


def cmd_predict(args) -> int:
    from enn_cluster.client.cli_ops import plan_from_flags, say_last
    from enn_cluster.client.launching import launch
    from enn_cluster.client.prediction_request import (
        DEFAULT_BATCH_SIZE,
        DEFAULT_CHUNK_ROWS,
        check_prediction_inputs,
        prepare_prediction,
    )
    from enn_cluster.storage.rundir import RunDir

    run = RunDir.existing(args.run_dir)
    cfg = run.load_config()
    check_prediction_inputs(run, cfg, args.input)
    # staged only: the shape is the sbatch job's, not this machine's
    plan = plan_from_flags(args, cfg, "predict", machine=not args.prepare_only)
    sharded = sharded_prediction(args, cfg, plan.shape)
    request = prepare_prediction(
        run, args.input, name=args.name, step=args.step,
        chunk_rows=DEFAULT_CHUNK_ROWS if args.chunk_rows is None else args.chunk_rows,
        batch_size=DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size,
        cfg=cfg, generate=generation(cfg, args.generate, args.seed), sharded=sharded)
    hint = f"enn-submit collect {run.path} --name {request.name} --out FILE.npy"
    if request.complete:
        print(f"prediction {request.name} is already complete; assemble it with: {hint}",
              file=sys.stderr)
        print(request.name)
        return 0
    if args.prepare_only:
        print(f"prediction {request.name} staged (step-{request.step}), nothing started; run it "
              f"with: ENN_RUN_DIR={shlex.quote(str(run.path))} ENN_PREDICT_NAME="
              f"{shlex.quote(request.name)} sbatch [flags] slurm/predict.sbatch, or enn-submit "
              f"predict {shlex.quote(str(run.path))} --name {shlex.quote(request.name)}",
              file=sys.stderr)
        print(request.name)
        say_last(request.fallback)
        return 0
    code = launch(run, plan, name=request.name, step=request.step)
    if args.cluster == "local":  # on Slurm, stdout carries the job id
        if code == 0:
            print(f"prediction {request.name} committed; assemble it with: {hint}",
                  file=sys.stderr)
        print(request.name)
    say_last(request.fallback)
    return code


def sharded_prediction(args, cfg, shape) -> bool:
    """--sharded, or a causal LM too big for one GPU's replica (site gpu_mem_gb)."""
    from enn_cluster.client.cli_ops import site_config
    from enn_cluster.client.model_shape import replica_fits

    if args.sharded or not replica_fits(cfg, shape.gpus_per_node, None if not shape.gpus_per_node
                                        else site_config(args).gpu_mem_gb):
        from enn_cluster.models import kind_of

        if not kind_of(cfg).predicts_sharded:
            raise UserError("--sharded: only a causal LM (model.name: hf:DIR) predicts sharded")
        if args.seed is not None:
            raise UserError("--seed: a sharded model continues rows greedily only; drop --seed "
                            "or predict with a replica per rank")
        return True
    return False


def generation(cfg, new_tokens, seed):
    """--generate/--seed as the request's `generate` (None: score rows)."""
    from enn_cluster.client.prediction_request import generation_request

    return generation_request(cfg, new_tokens, seed)


def cmd_collect(args) -> int:
    from enn_cluster.client.collect import collect
    from enn_cluster.storage.rundir import RunDir

    run = RunDir.existing(args.run_dir)
    result = collect(run, args.name, args.out, raw=args.raw, overwrite=args.overwrite)
    print(f"collected {result.name} (step-{result.step}): {result.shape[0]} rows of shape "
          f"{tuple(result.shape[1:])}", file=sys.stderr)
    for line in result.notes:
        print(line, file=sys.stderr)
    for line in result.warnings:
        print(f"warning: {line}: predictions are almost identical across samples; "
              "see docs/troubleshooting.md", file=sys.stderr)
    if result.collapse:
        print(f"collapse verdict ({result.collapse['verdict']}): {result.collapse['message']}",
              file=sys.stderr)
    print(result.out)
    return 0
