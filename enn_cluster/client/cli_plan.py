"""`enn-submit plan`: will this run fit the GPUs? Per-GPU bytes of parameters, gradients,
optimizer state and activations (config/memory_plan.py has the formulas), from the model
built on the meta device. Registered on the parser here, so cli.py stays the shared core.
"""
from __future__ import annotations

import json

from enn_cluster.config.memory_plan import DEFAULT_GPU_MEM_GB, GB, memory_plan, refusal


def register(sub, commands) -> None:
    p = sub.add_parser("plan", help="will it fit? per-GPU memory of a training run, "
                       "computed on the meta device (nothing is written or launched)")
    p.add_argument("--config", default=None, help="run YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set lora.r=16 (repeatable)")
    p.add_argument("--nodes", default=None, help="nodes (default: parallel.nodes; MIN-MAX: "
                   "planned at MIN)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node (default: the site config's, else parallel.procs_per_node)")
    p.add_argument("--gpu-mem-gb", type=float, default=None,
                   help=f"memory of one GPU in GB (default: the site's gpu_mem_gb, else "
                        f"{DEFAULT_GPU_MEM_GB:g})")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--site", default=None, help="site config YAML (default: search order)")
    commands.update(plan=cmd_plan)


def cmd_plan(args) -> int:
    from enn_cluster.client.cli_ops import site_config
    from enn_cluster.client.launch_plan import plan_launch
    from enn_cluster.client.launching import load_flagged_config
    from enn_cluster.client.model_shape import model_shape
    from enn_cluster.config.launch_shape import ShapeRequest
    from enn_cluster.errors import UserError

    site = site_config(args)
    cfg = load_flagged_config(args.config, args.overrides, args.site, read_site=lambda: site)
    gpus = args.gpus_per_node if args.gpus_per_node is not None else site.gpus_per_node
    # the launch plan train would make (mesh and batch checked), for GPUs wherever they are
    shape = plan_launch(cfg, ShapeRequest(args.nodes, gpus)).shape
    mem = args.gpu_mem_gb if args.gpu_mem_gb is not None else \
        (site.gpu_mem_gb or DEFAULT_GPU_MEM_GB)
    if not 0 < mem <= 2**20:
        raise UserError(f"--gpu-mem-gb: {mem:g} must be the GB of memory of one GPU, e.g. 80")
    model = model_shape(cfg)
    if model is None:
        raise UserError(f"model.name: {cfg.model.name} cannot be built on the meta device, so "
                        "its memory plan is not known before the run (its workers build it "
                        "whole); to plan it, let the factory build under "
                        "torch.device('meta') (no from_pretrained inside it)")
    plan = memory_plan(cfg, model, shape.nodes, shape.procs_per_node, mem)
    if args.json:
        print(json.dumps(plan.as_json()))
    else:
        print(format_plan(plan, model.params, shape.nodes, shape.procs_per_node, mem,
                          cfg.parallel.activation_checkpointing))
        if not plan.fits:
            print(refusal(cfg, model, shape.nodes, shape.procs_per_node, mem))
    return 0 if plan.fits else 1


def format_plan(plan, params: int, nodes: int, gpus: int, mem: float, checkpointing: str) -> str:
    gb = lambda v: f"{v / GB:8.2f} GB"  # noqa: E731
    return "\n".join([
        f"{params:,} parameters ({plan.trainable_params:,} trainable), {nodes} x {gpus} "
        f"GPUs, shards of {plan.shard_group}, micro-batch {plan.micro_batch} x "
        f"{plan.seq_len} tokens; per GPU:",
        f"  parameters    {gb(plan.params)}",
        f"  gradients     {gb(plan.grads)}",
        f"  optimizer     {gb(plan.optimizer)}",
        f"  activations   {gb(plan.activations)}  (checkpointing {checkpointing}; none: "
        f"{plan.activations_none / GB:.2f} GB, full: {plan.activations_full / GB:.2f} GB)",
        f"  total         {gb(plan.total)}  of {plan.usable / GB:.2f} GB usable "
        f"({mem:g} GB less 10 % and 1 GB for the CUDA context): "
        + ("fits" if plan.fits else "does NOT fit"),
    ])
