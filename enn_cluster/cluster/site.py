"""The site config an HPC admin writes once (YAML, no Python): partition, account,
mounts, image, NCCL profile, extra sbatch/srun arguments, setup lines.

Why a file: users should not repeat cluster facts on every command. Lookup order (the
first file found wins, files are not layered):
  1. `--site FILE`            (must exist)
  2. `$ENN_SITE_CONFIG`       (must exist)
  3. `./enn-site.yaml`
  4. `~/.config/enn_cluster/site.yaml`
  5. `/etc/enn_cluster/site.yaml`
Values then layer as `merge(DEFAULTS, site, cli_flags)`: a command-line flag wins over
the site file, which wins over the defaults. Parsing is pure; only `load_site` reads files.
See slurm/site.example.yaml for every key, documented.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from enn_cluster.cluster import pyxis, slurm_values
from enn_cluster.config import nccl
from enn_cluster.config.launch_options import LIST, OPTIONS
from enn_cluster.errors import UserError, did_you_mean

ENV_VAR = "ENN_SITE_CONFIG"
LOCAL_NAME = "enn-site.yaml"
USER_PATH = ".config/enn_cluster/site.yaml"  # under the home directory
SYSTEM_PATH = "/etc/enn_cluster/site.yaml"

# the site file's keys, typing and defaults are the launch options' (launch_options.py)
SITE_OPTIONS = {o.site: o for o in OPTIONS if o.site}
KEYS = tuple(SITE_OPTIONS)
DEFAULTS: dict[str, Any] = {key: o.default for key, o in SITE_OPTIONS.items()}


def _overrides(self) -> dict[str, Any]:
    """The keys this site sets."""
    return {key: getattr(self, key) for key in KEYS if getattr(self, key) is not None}


SiteConfig = dataclasses.make_dataclass(
    "SiteConfig",
    [(key, Any, None) for key in KEYS] +
    [("source", Optional[str], field(default=None, compare=False))],  # the file it came from
    frozen=True, namespace={
        "__module__": __name__, "overrides": _overrides,
        "__doc__": "One site file: a field per site key (None: 'not set here', DEFAULTS or "
                   "flags decide) and `source`, the file it came from."})


def _where(source: Optional[str]) -> str:
    return f" (in {source})" if source else ""


def _typed(key: str, value: Any, source: Optional[str]) -> Any:
    """Check one value's YAML type (its option's kind); lists become tuples."""
    kind = SITE_OPTIONS[key].kind
    if not kind.holds(value):
        raise UserError(f"site.{key}: expected {kind.expected}, got {kind.shown(value)}"
                        f"{_where(source)}{kind.fix}")
    return tuple(value) if kind is LIST else value


def _check_values(site: SiteConfig) -> None:
    """Meaning, not just type: each error names site.<key> and the fix."""
    where = _where(site.source)
    try:
        for flag in ("partition", "account", "qos"):
            slurm_values.check_word(getattr(site, flag), f"site.{flag}")
        for i, mount in enumerate(site.mounts or ()):
            pyxis.parse_mount(mount, f"site.mounts[{i}]")
        for key in ("runs_root", "image_cache"):
            if getattr(site, key) is not None:
                pyxis.check_path(getattr(site, key), f"site.{key}")
        if site.image is not None and not pyxis.is_bare_metal(site.image):
            pyxis.check_image(site.image, "site.image")
        if site.nccl_profile is not None:
            nccl.check_profile(site.nccl_profile, "site.nccl_profile")
        if site.time is not None:
            slurm_values.time_minutes(site.time, "site.time")
        if site.signal_grace_s is not None and site.signal_grace_s < 1:
            raise UserError(f"site.signal_grace_s: {site.signal_grace_s} must be >= 1 second")
        if site.socket_ifname is not None and not re.fullmatch(r"[A-Za-z0-9_.:-]{1,15}",
                                                               site.socket_ifname):
            raise UserError(f"site.socket_ifname: {site.socket_ifname!r} is not an interface "
                            "name; give one name such as eth0 or ib0 (see `ip -br link`)")
        if site.cpus_per_task is not None and not \
                1 <= site.cpus_per_task <= slurm_values.MAX_CPUS_PER_TASK:
            bound = ">= 1" if site.cpus_per_task < 1 else \
                f"at most {slurm_values.MAX_CPUS_PER_TASK}"
            raise UserError(f"site.cpus_per_task: {slurm_values.short_value(site.cpus_per_task)} "
                            f"must be {bound}; "
                            "leave it out for the node's CPUs divided by its tasks")
        if site.mem_gb is not None:
            slurm_values.check_mem_gb(site.mem_gb, "site.mem_gb")
        if site.gpu_mem_gb is not None and not 1 <= site.gpu_mem_gb <= 2**20:
            raise UserError(f"site.gpu_mem_gb: {site.gpu_mem_gb!r} must be the GB of memory "
                            "of one GPU, e.g. 80")
        if site.gpu_request is not None:
            slurm_values.check_gpu_request(site.gpu_request, "site.gpu_request")
        slurm_values.check_word(site.wckey, "site.wckey")
        if site.whole_node_gpus is not None and site.whole_node_gpus < 0:
            raise UserError(f"site.whole_node_gpus: {site.whole_node_gpus} must be >= 0 "
                            "(the GPUs on one node; 0: never ask for whole nodes)")
        if site.gpus_per_node is not None and not \
                0 <= site.gpus_per_node <= slurm_values.MAX_GPUS_PER_NODE:
            raise UserError(f"site.gpus_per_node: {slurm_values.short_value(site.gpus_per_node)} "
                            f"must be from 0 "
                            f"to {slurm_values.MAX_GPUS_PER_NODE}")
        for i, arg in enumerate(site.extra_sbatch_args or ()):
            slurm_values.parse_sbatch_arg(arg, f"site.extra_sbatch_args[{i}]")
        for i, arg in enumerate(site.extra_srun_args or ()):
            slurm_values.check_srun_arg(arg, f"site.extra_srun_args[{i}]")
        for i, line in enumerate(site.setup_lines or ()):
            slurm_values.check_line(line, f"site.setup_lines[{i}]")
    except UserError as exc:
        raise UserError(f"{exc}{where}") from None


def parse_site(data: Any, source: Optional[str] = None) -> SiteConfig:
    """A parsed YAML document -> SiteConfig (an empty document is an empty config)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise UserError(f"site: the file must be a mapping of keys{_where(source)}; "
                        "see slurm/site.example.yaml")
    unknown = sorted(str(k) for k in data if k not in KEYS)
    if unknown:
        raise UserError(f"site.{unknown[0]}: unknown key{did_you_mean(unknown[0], KEYS)}"
                        f"{_where(source)}; "
                        f"known keys: {', '.join(KEYS)}")
    values = {k: _typed(k, v, source) for k, v in data.items() if v is not None}
    site = SiteConfig(**values, source=source)
    _check_values(site)
    return site


def search_paths(flag: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
                 cwd: Optional[str] = None, home: Optional[str] = None,
                 system_path: str = SYSTEM_PATH) -> list[tuple[Path, bool]]:
    """Candidate files in lookup order, each with 'must exist'."""
    environ = os.environ if environ is None else environ
    out: list[tuple[Path, bool]] = []
    if flag:
        out.append((Path(flag), True))
    if environ.get(ENV_VAR):
        out.append((Path(environ[ENV_VAR]), True))
    out.append((Path(cwd or os.getcwd()) / LOCAL_NAME, False))
    home = home if home is not None else environ.get("HOME") or os.path.expanduser("~")
    out.append((Path(home) / USER_PATH, False))
    out.append((Path(system_path), False))
    return out


def find_site_file(flag: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
                   cwd: Optional[str] = None, home: Optional[str] = None,
                   system_path: str = SYSTEM_PATH) -> Optional[Path]:
    for path, required in search_paths(flag, environ, cwd, home, system_path):
        if path.is_file():
            return path
        if required:
            origin = "--site" if flag and path == Path(flag) else f"${ENV_VAR}"
            raise UserError(f"site: {origin} names {str(path)!r}, which is not a file; "
                            "fix the path or drop it")
    return None


def load_site(flag: Optional[str] = None, environ: Optional[Mapping[str, str]] = None,
              cwd: Optional[str] = None, home: Optional[str] = None,
              system_path: str = SYSTEM_PATH) -> SiteConfig:
    """The first site file in lookup order, parsed; an empty config when there is none."""
    path = find_site_file(flag, environ, cwd, home, system_path)
    if path is None:
        return SiteConfig()
    import yaml  # here, not at import: the CLI's fast paths never need it

    from enn_cluster.config.yaml_file import load_text

    try:
        data = load_text(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"site: cannot read {path}: {exc}; fix its permissions") from None
    except RecursionError:
        raise UserError(f"site: {path} is nested too deeply to be a site file; fix it") from None
    except ValueError as exc:  # a date such as 2023-13-45, a number of thousands of digits
        first = (str(exc).splitlines() or ["a value does not parse"])[0][:200]
        raise UserError(f"site: {path} holds a value that does not parse ({first}); "
                        "fix it") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"site: {path}{at} is not valid YAML "
                        f"({getattr(exc, 'problem', None) or exc}); fix the syntax") from None
    return parse_site(data, str(path))


def merge(defaults: Mapping[str, Any], site: Union[SiteConfig, Mapping[str, Any]],
          cli_flags: Mapping[str, Any]) -> dict[str, Any]:
    """defaults < site < command-line flags; None in a layer means 'not given there'.
    Lists are replaced, not concatenated: a flag's list is the whole list."""
    out = dict(defaults)
    layers = (site.overrides() if isinstance(site, SiteConfig) else site, cli_flags)
    for layer in layers:
        out.update({k: v for k, v in layer.items() if v is not None})
    return out
