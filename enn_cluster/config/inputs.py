"""Every input a user gives by a name that differs between front ends, one row each: its
CLI flag (or argument), the API's word for it and the site file's key. The launch options'
rows come from their table (config/launch_options.py); the others are the few CLI inputs the
Python API takes too. A UserError about one of them names the row (errors.UserError's
`field`), and each front end renders it in its own words: `--gpus-per-node 0` on the command
line, `cluster["gpus_per_node"]=0` from the API, `gpus_per_node: 0` in a site file."""
from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Optional

from enn_cluster.config.launch_options import OPTIONS
from enn_cluster.errors import Said


@dataclass(frozen=True)
class Input:
    """One user-facing input. None in a column: that front end does not take it (its name
    there falls back to the CLI's, the one every front end's docs show)."""

    name: str
    cli: str  # the flag, or the positional argument's metavar (RUN_DIR)
    api: Optional[str] = None  # the API's argument (`step`), or `cluster["key"]`
    site: Optional[str] = None  # the site file's key

    def __str__(self) -> str:  # where a message formats it as text: the CLI's name
        return self.cli

    def named(self, front: str) -> str:
        """Its name in `front` (errors.FRONT_ENDS)."""
        return self._column(self.spoken(front))

    def item(self, index: int) -> "Input":
        """One item of a list input: `--container-mounts[0]`, `cluster["mounts"][0]`."""
        return replace(self, cli=f"{self.cli}[{index}]",
                       api=self.api and f"{self.api}[{index}]",
                       site=self.site and f"{self.site}[{index}]")

    def spoken(self, front: str) -> str:
        """The front end whose words name it where `front`'s have none: the CLI's."""
        return front if self._column(front) else "cli"

    def _column(self, front: str) -> Optional[str]:
        return {"cli": self.cli, "api": self.api, "site": self.site}[front]

    def said(self, front: str, value, name: str) -> str:
        """It with the value given, as `front` writes it (`name`: its name there)."""
        if front == "api" and self.name == "cluster":  # --cluster slurm / local
            return "cluster={...}" if value == "slurm" else "cluster=None"
        if front == "api" and self.name == "set":  # --set training.lr=V: training={'lr': V}
            key, _, given = str(value).partition("=")
            section, dot, rest = key.partition(".")
            shown = given if given.isupper() or given in ("", "...") else _python_text(given)
            return f"{section}={{{rest!r}: {shown}}}" if dot else f"{key}={shown}"
        if front == "api":  # a placeholder (IMAGE) as it is, a value as Python writes it
            return f"{name}={value}" if str(value).isupper() else f"{name}={value!r}"
        if front == "site":
            return f"{name}: {value}"
        return f"{name} {shlex.quote(str(value))}" if self.cli.startswith("-") else shlex.quote(
            str(value))


def _python_text(text: str) -> str:
    """A --set value (YAML text) as Python text for the API's keyword: a number as written
    (YAML 1.1 reads 1e-4 as a string, the CLI as the float), true/null as True/None, any
    other text quoted."""
    import ast

    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return repr(text)
    if isinstance(value, str):
        try:
            ast.literal_eval(text)
            return text
        except (ValueError, SyntaxError):
            return repr(text)
    return repr(value)


# the CLI's inputs that the API also takes (as an argument of train, predict, export, Run)
OTHER_INPUTS = (
    Input("run_dir", "RUN_DIR", "run_or_dir"),  # train's is `run_dir`, Run.open's `path`
    Input("input", "--input", "X"),
    Input("step", "--step", "step"),
    Input("name", "--name", "name"),
    Input("out", "--out", "out"),
    Input("format", "--format", "format"),
    Input("dtype", "--dtype", "dtype"),
    Input("max_shard_mb", "--max-shard-mb", "max_shard_mb"),
    Input("chunk_rows", "--chunk-rows", "chunk_rows"),
    Input("batch_size", "--batch-size", "batch_size"),
    Input("raw", "--raw", "raw"),
    Input("config", "--config", "config"),
    Input("set", "--set", "the keyword sections"),  # train(..., training={...})
    Input("cluster", "--cluster", "cluster"),
    # the job's own words for two launch options (cluster/job_script.py: Pyxis' srun flags)
    Input("container_image", "--container-image", 'cluster["container"]', "image"),
    Input("container_mounts", "--container-mounts", 'cluster["mounts"]', "mounts"),
)

INPUTS: dict[str, Input] = {
    **{o.name: Input(o.name, o.flag, f'cluster["{o.api}"]' if o.api else None, o.site)
       for o in OPTIONS if o.flag},
    **{i.name: i for i in OTHER_INPUTS},
}

ON_SLURM = Said(INPUTS["cluster"], "slurm")  # --cluster slurm; the API's cluster={...}
