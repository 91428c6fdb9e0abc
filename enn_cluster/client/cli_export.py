"""`enn-submit export`: registered on the parser here, so cli.py stays the shared core."""
from __future__ import annotations

import sys


def register(sub, commands) -> None:
    from enn_cluster.client.artifact_export import FORMATS

    p = sub.add_parser("export", help="consolidate a checkpoint into an inference artifact")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--out", required=True, help="directory to create (must not exist)")
    p.add_argument("--format", default="torch", choices=FORMATS,
                   help="torch: model.pt (full state dict); export: also model.pt2, a "
                        "torch.export program; hf: a Hugging Face model directory (LoRA "
                        "merged) with the tokenizer; peft: the LoRA adapters alone")
    p.add_argument("--dtype", default=None,
                   help="--format hf: the dtype written (bfloat16, float16, float32; "
                        "default: the base weights' own)")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="--format hf: the largest safetensors file, in MB (default 5000)")
    commands.update(export=cmd_export)


def cmd_export(args) -> int:
    from enn_cluster.client.artifact_export import export_run
    from enn_cluster.client.cli_ops import say_last

    said: list = []
    out = export_run(args.run_dir, args.out, step=args.step, fmt=args.format, said=said,
                     dtype=args.dtype, max_shard_mb=args.max_shard_mb)
    print(f"exported to {out}", file=sys.stderr)
    print(out)
    say_last("\n".join(said))
    return 0
