"""The launch options table (config/launch_options.py) is the one home of an option: every
row is taken by each front end it names (CLI flag, API `cluster=` key, site key) and the
same value reaches its JobSpec field; no other module spells a list of the options; and a
row added to a copy of the package is the only edit a new option needs."""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from enn_cluster.client.api import _check_cluster, _plan, _slurm_request
from enn_cluster.client.cli import build_parser
from enn_cluster.client.cli_ops import plan_from_flags
from enn_cluster.cluster import site
from enn_cluster.config.inputs import INPUTS
from enn_cluster.config.launch_options import API_KEYS, LIST, OPTIONS
from enn_cluster.config.loading import config_from_dict
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import run_dir_for
from helpers import ROOT, controller_up_scontrol, slurm_answers_here, small_config

PKG = ROOT / "enn_cluster"
BASE_IMAGE = "/img/base.sqsh"
LAUNCH_COMMANDS = ("train", "prepare", "resume", "predict", "render")

# A value each option takes, for this test only (a new row needs its sample here); "site":
# the test's own second site file.
SAMPLES = {
    "partition": "gpu", "account": "proj", "qos": "high", "time": "02:00:00",
    "exclusive": True, "container": "/img/e.sqsh", "mounts": ["/data:/data:ro"],
    "python": "/opt/venv/bin/python3", "site": "named-site.yaml", "job_name": "exp-1",
    "cpus_per_task": 6, "mem_gb": 64.5, "signal_grace": 120, "nodes": "2-3",
    "gpus_per_node": 4, "procs_per_node": 3, "max_restarts": 2, "spare_nodes": 1,
    "runs_root": "/shared/runs",
    "image_cache": "/shared/img", "nccl_profile": "ib",
    "extra_sbatch_args": ["--constraint=a100"], "extra_srun_args": ["--cpu-bind=none"],
    "setup_lines": ["module load x"], "socket_ifname": "ib0", "gpu_request": "gres",
    "gpu_mem_gb": 141, "wckey": "ml", "whole_node_gpus": 4, "allow_socket_fallback": True,
}


def _cli_words(option, value) -> list[str]:
    """`value` as the command line gives it."""
    if option.kind is LIST:
        return [w for item in value for w in (option.flag, item)]
    return [option.flag] if value is True else [option.flag, str(value)]


@pytest.fixture
def jobs(tmp_path, monkeypatch):
    """The Slurm job each front end plans for a new run: `cli(argv)`, `api(cluster)`, with
    `site(data)` the site file ($ENN_SITE_CONFIG) both read; Slurm answers here."""
    slurm_answers_here(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict(small_config(tmp_path, "options"))
    path = tmp_path / "site.yaml"
    monkeypatch.setenv("ENN_SITE_CONFIG", str(path))

    def write_site(data: dict) -> None:
        path.write_text(yaml.safe_dump({"image": BASE_IMAGE, **data}))

    def cli(argv: list) -> object:
        args = build_parser().parse_args(["train", "--cluster", "slurm", *argv])
        return plan_from_flags(args, cfg, run_dir=run_dir_for(cfg).path).spec

    def api(cluster: dict) -> object:
        _check_cluster(cluster)
        return _plan(cfg, cluster, "train", _slurm_request(cluster)).for_job(
            run_dir_for(cfg).path).spec

    write_site({})
    (tmp_path / SAMPLES["site"]).write_text(yaml.safe_dump({"image": BASE_IMAGE,
                                                            "partition": "named"}))
    return cli, api, write_site


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_every_front_end_of_an_option_takes_it_and_the_job_gets_the_same_value(option, jobs):
    cli, api, write_site = jobs
    assert option.name in SAMPLES, f"add a sample value of {option.name} to SAMPLES"
    value = SAMPLES[option.name]
    expected = tuple(value) if option.kind is LIST else value
    assert option.api in (None, option.name), "the API key is the option's name"
    got = {}
    if option.flag:
        got["flag"] = cli(_cli_words(option, value))
        if option.api:  # the API's errors name its key where the CLI's name the flag
            assert INPUTS[option.name].named("api") == f'cluster["{option.api}"]'
            assert INPUTS[option.name].named("cli") == option.flag
    if option.api:
        got["cluster="] = api({option.api: value})
    if option.site:
        write_site({option.site: value})
        assert getattr(site.load_site(), option.site) == expected
        assert option.site in site.DEFAULTS and site.DEFAULTS[option.site] == option.default
        got["site"] = cli([])
        write_site({})
    assert got or option.site, f"{option.name}: in no front end"
    for where, spec in got.items():
        if option.spec:
            assert getattr(spec, option.spec) == expected, where
        elif option.name == "site":  # the site file it names is the one read
            assert spec.partition == "named", where


def test_each_launch_command_has_the_launch_flags_and_no_other_hand_made_one():
    """Every flag of the table is on every command that launches, and the launch flags are
    the table's (a flag added by hand beside the table would be a second home)."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    table = {o.flag for o in OPTIONS if o.flag}
    for command in LAUNCH_COMMANDS:
        flags = {f for a in subparsers[command]._actions for f in a.option_strings}
        assert table <= flags, (command, table - flags)
    from enn_cluster.client.cli import _add_shape_flags

    bare = argparse.ArgumentParser()
    _add_shape_flags(bare)
    launch = {f for a in bare._actions for f in a.option_strings}
    assert launch - table == {"-h", "--help", "--cluster", "--wait"}


def test_the_site_file_is_typed_by_the_table():
    """Each key is refused with its kind's words; the kind is the row's."""
    kinds = {o.site: o.kind for o in OPTIONS if o.site}
    assert set(kinds) == set(site.KEYS) == set(site.DEFAULTS)
    for key, kind in kinds.items():
        with pytest.raises(UserError, match=rf"^site\.{key}: expected {kind.expected}, got"):
            site.parse_site({key: {"a": "mapping"}})


def test_the_api_refuses_a_cluster_key_it_does_not_know(tmp_path):
    """A mistyped `cluster=` key was ignored (the job went to the site's partition): now it is
    refused, naming the closest key, before anything is written; a string where a list of
    mounts goes is one mount (it was split into characters)."""
    import enn_cluster

    with pytest.raises(UserError, match=r'^cluster\["partiton"\]: unknown key \(did you mean '
                                        r'partition\?\); known keys: partition, account'):
        enn_cluster.train("api_models:tiny", [[0.0]], run_dir=str(tmp_path / "r"),
                          cluster={"partiton": "gpu"})
    assert not (tmp_path / "r").exists()
    with pytest.raises(UserError, match=r"^cluster: expected a dict"):
        enn_cluster.predict(str(tmp_path / "r"), [[0.0]], cluster="slurm")
    with pytest.raises(UserError, match=r'^cluster\["max_restarts"\]: unknown key'):
        _check_cluster({"max_restarts": 2})  # the config's parallel.max_restarts, for the API
    _check_cluster({key: None for key in API_KEYS})
    request = _slurm_request({"mounts": "/data:/data", "container": BASE_IMAGE},
                             read_site=lambda: site.SiteConfig())
    assert request.asked["mounts"] == ("/data:/data",)


# -- one home ---------------------------------------------------------------------------

# Modules that hold other programs' names, which happen to be the options' too: sbatch's own
# options (slurm_values.MANAGED_SBATCH), submitit's parameters (submitit_adapter's), and
# the JobSpec and its script: the table's last column, the job as Slurm gets it.
OTHER_VOCABULARIES = ("cluster/slurm_values.py", "cluster/submitit_adapter.py",
                      "cluster/job_spec.py", "cluster/job_script.py")


def _vocabulary() -> set:
    """Every name an option goes by (but the launch shape's: config/launch_shape.py's)."""
    words = set()
    for o in OPTIONS:
        if not o.shape:
            words |= {o.name, o.api, o.site, o.flag, o.flag and o.flag[2:]} - {None}
    return words


def option_lists(source: str, words: set, at_least: int = 4) -> list:
    """(line, names) of each literal (tuple, list, set, dict keys), call (its keywords) or
    class (its fields) of `source` that names `at_least` of `words`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        elif isinstance(node, ast.Dict):
            names = [k.value for k in node.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Call):
            names = [k.arg for k in node.keywords]
        elif isinstance(node, ast.ClassDef):
            names = [s.target.id for s in node.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        else:
            continue
        names = [n for n in names if isinstance(n, str) and n in words]
        if len(names) >= at_least:
            found.append((node.lineno, names))
    return found


# The sides that read the options (the front ends, the site file, the Slurm request); the
# worker and storage never take them from a user (a jobs.jsonl record is what a job was).
READERS = ("client", "cluster", "config")


def test_no_other_module_spells_a_list_of_the_options():
    words = _vocabulary()
    found = []
    for path in sorted(p for side in READERS for p in (PKG / side).rglob("*.py")):
        name = path.relative_to(PKG).as_posix()
        if name in ("config/launch_options.py", *OTHER_VOCABULARIES):
            continue
        found += [f"{name}:{line}: {names}" for line, names in
                  option_lists(path.read_text(encoding="utf-8"), words)]
    assert not found, "options listed outside config/launch_options.py:\n" + "\n".join(found)


def test_the_check_sees_the_lists_the_table_replaced():
    """What site.py, api.py, api_words.py and cli_ops.py spelled before the table."""
    before = '''
DEFAULTS = {"partition": None, "account": None, "qos": None, "mounts": ()}
_LISTS = ("mounts", "extra_sbatch_args", "extra_srun_args", "setup_lines")
CLUSTER_FLAGS = ("partition", "account", "qos", "time", "job-name")
req = SlurmRequest(partition=a.partition, account=a.account, qos=a.qos, time=a.time)
class SiteConfig:
    partition: str
    account: str
    qos: str
    image: str
'''
    assert sorted(line for line, _ in option_lists(before, _vocabulary())) == [2, 3, 4, 5, 6]


ROW = ('    Option("container_workdir", "--container-workdir", "container_workdir", '
       '"container_workdir", "container_workdir", STR, None, "working directory in the '
       'container"),\n')

# Run against a package: whether each front end takes the new option, and where it lands.
FOLLOW = r'''
import json, os, sys
import enn_cluster
from contextlib import redirect_stderr
from io import StringIO
from pathlib import Path
from enn_cluster.client.api import _check_cluster, _plan, _slurm_request
from enn_cluster.client.cli import build_parser
from enn_cluster.client.cli_ops import plan_from_flags
from enn_cluster.cluster import site
from enn_cluster.config.inputs import INPUTS
from enn_cluster.config.loading import config_from_dict
from enn_cluster.errors import UserError
from enn_cluster.storage.rundir import run_dir_for
from helpers import small_config

tmp = Path(sys.argv[1])
cfg = config_from_dict(small_config(tmp, "row"))
run_dir = run_dir_for(cfg).path
out = {"package": enn_cluster.__file__, "words": INPUTS["container_workdir"].named("api")
       if "container_workdir" in INPUTS else None,
       "default": site.DEFAULTS.get("container_workdir", "absent")}
try:
    with redirect_stderr(StringIO()):
        args = build_parser().parse_args(["train", "--cluster", "slurm",
                                          "--container-workdir", "/work/cli"])
    out["flag"] = plan_from_flags(args, cfg, run_dir=run_dir).spec.container_workdir
except SystemExit:
    out["flag"] = "refused"
try:
    cluster = {"container_workdir": "/work/api"}
    _check_cluster(cluster)
    out["cluster="] = _plan(cfg, cluster, "train", _slurm_request(cluster)).for_job(
        run_dir).spec.container_workdir
except UserError as exc:
    out["cluster="] = str(exc)
try:
    Path(os.environ["ENN_SITE_CONFIG"]).write_text(
        "image: /img/base.sqsh\ncontainer_workdir: /work/site\n")
    args = build_parser().parse_args(["train", "--cluster", "slurm"])
    out["site"] = plan_from_flags(args, cfg, run_dir=run_dir).spec.container_workdir
    site.parse_site({"container_workdir": 5})
except UserError as exc:
    out["site typed"] = str(exc)
print(json.dumps(out))
'''


def _follow(package_parent: Path, tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_parent), str(ROOT / "tests")]),
               PATH=f"{bin_dir}:{os.environ['PATH']}", ENN_SITE_CONFIG=str(tmp_path / "site.yaml"),
               PYTHONDONTWRITEBYTECODE="1")
    (tmp_path / "site.yaml").write_text("image: /img/base.sqsh\n")
    res = subprocess.run([sys.executable, "-c", FOLLOW, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out.pop("package") == str(package_parent / "enn_cluster" / "__init__.py")
    return out


def test_a_new_option_is_one_row(tmp_path):
    """A copy of the package with one row more (the JobSpec's container_workdir, which no
    front end offers yet) takes the option from the CLI, the API and the site file, types
    it, and hands it to the job; the package as it is refuses it everywhere."""
    copy = tmp_path / "copy"
    shutil.copytree(PKG, copy / "enn_cluster", ignore=shutil.ignore_patterns("__pycache__"))
    table = copy / "enn_cluster" / "config" / "launch_options.py"
    text = table.read_text(encoding="utf-8")
    end = text.index("\n)\n", text.index("OPTIONS: tuple[Option, ...] = ("))
    table.write_text(text[:end + 1] + ROW + text[end + 1:], encoding="utf-8")

    (tmp_path / "as-is").mkdir()
    (tmp_path / "one-row-more").mkdir()
    as_is = _follow(ROOT, tmp_path / "as-is")
    assert as_is["flag"] == "refused" and as_is["words"] is None
    assert as_is["cluster="].startswith('cluster["container_workdir"]: unknown key')
    assert as_is["site typed"].startswith("site.container_workdir: unknown key")

    added = _follow(copy, tmp_path / "one-row-more")
    assert (added["flag"], added["cluster="], added["site"]) == \
        ("/work/cli", "/work/api", "/work/site")
    assert added["words"] == 'cluster["container_workdir"]' and added["default"] is None
    assert added["site typed"].startswith("site.container_workdir: expected a non-empty string")
