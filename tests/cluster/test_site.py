"""Site config: lookup order, precedence, and errors that name site.<key>."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from enn_cluster.cluster import site
from enn_cluster.errors import UserError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def places(tmp_path):
    """Every lookup location, inside tmp_path; write(name) puts a file there."""
    p = {"flag": tmp_path / "flag.yaml", "env": tmp_path / "env.yaml",
         "cwd": tmp_path / "cwd" / site.LOCAL_NAME, "home": tmp_path / "home" / site.USER_PATH,
         "system": tmp_path / "etc" / "site.yaml"}
    for path in p.values():
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(name, **data):
        p[name].write_text(yaml.safe_dump({"partition": name, **data}))

    def load(flag=True, env=True):
        return site.load_site(str(p["flag"]) if flag else None,
                              {site.ENV_VAR: str(p["env"])} if env else {},
                              cwd=str(p["cwd"].parent), home=str(tmp_path / "home"),
                              system_path=str(p["system"]))
    return p, write, load


def test_search_order(places):
    p, write, load = places
    for name in p:
        write(name)
    assert load().partition == "flag"
    assert load(flag=False).partition == "env"
    assert load(flag=False, env=False).partition == "cwd"
    p["cwd"].unlink()
    assert load(flag=False, env=False).partition == "home"
    p["home"].unlink()
    found = load(flag=False, env=False)
    assert found.partition == "system" and found.source == str(p["system"])
    p["system"].unlink()
    assert load(flag=False, env=False) == site.SiteConfig()


def test_named_files_must_exist(places):
    p, write, load = places
    with pytest.raises(UserError, match="--site names .*flag.yaml.*not a file"):
        load()
    with pytest.raises(UserError, match=r"\$ENN_SITE_CONFIG names .*env.yaml"):
        load(flag=False)


def test_precedence_flags_over_site_over_defaults():
    conf = site.parse_site({"partition": "gpu", "time": "02:00:00", "mounts": ["/a:/a"]})
    merged = site.merge(site.DEFAULTS, conf, {"partition": "debug", "time": None})
    assert merged["partition"] == "debug"  # flag wins
    assert merged["time"] == "02:00:00"  # site wins over default (None flag = not given)
    assert merged["mounts"] == ("/a:/a",)
    assert merged["python"] == "python3" and merged["signal_grace_s"] == 90  # defaults
    assert site.merge(site.DEFAULTS, {}, {"mounts": ["/b:/b"]})["mounts"] == ["/b:/b"]


def test_every_key_is_known_and_typed():
    conf = site.parse_site({
        "partition": "gpu", "account": "acct", "qos": "normal", "mounts": ["/d:/d:ro+rprivate"],
        "runs_root": "/shared/runs", "image_cache": "/shared/img", "image": "/shared/img/a.sqsh",
        "nccl_profile": "efa", "gpus_per_node": 4, "extra_sbatch_args": ["--constraint=a100"],
        "extra_srun_args": ["--cpu-bind=none"], "setup_lines": ["module load x"],
        "python": "/usr/bin/python3", "signal_grace_s": 120, "time": 240,
        "cpus_per_task": 12, "socket_ifname": "ib0", "mem_gb": 480, "gpu_request": "gres:a100",
        "gpu_mem_gb": 141, "wckey": "ml", "whole_node_gpus": 4,
        "allow_socket_fallback": False, "spare_nodes": 1})
    assert set(conf.overrides()) == set(site.KEYS) == set(site.DEFAULTS)
    assert conf.mounts == ("/d:/d:ro+rprivate",)


@pytest.mark.parametrize("data, message", [
    ({"partiton": "gpu"}, r"site\.partiton: unknown key .*known keys: partition"),
    ({"mounts": "/a:/a"}, r"site\.mounts: expected a list of strings, got str"),
    ({"setup_lines": [1]}, r"site\.setup_lines: expected a list of strings"),
    ({"signal_grace_s": "90"}, r"site\.signal_grace_s: expected a whole number"),
    ({"gpus_per_node": True}, r"site\.gpus_per_node: expected a whole number"),
    ({"gpu_mem_gb": "80GB"}, r"site\.gpu_mem_gb: expected a number of GB"),
    ({"gpu_mem_gb": 0}, r"site\.gpu_mem_gb: 0 must be the GB of memory of one GPU"),
    ({"time": [4]}, r"site\.time: expected minutes or a Slurm time"),
    ({"time": "4 hours"}, r"site\.time: '4 hours' is not a time"),
    ({"partition": 5}, r"site\.partition: expected a non-empty string"),
    ({"partition": "gpu a"}, r"site\.partition: .*cannot carry"),
    ({"mounts": ["/a:/a", "data:/data"]}, r"site\.mounts\[1\]: mount source 'data' must be absolute"),
    ({"mounts": ["/a:/a:fast"]}, r"site\.mounts\[0\]: .*unknown flags \['fast'\]"),
    ({"nccl_profile": "roce"}, r"site\.nccl_profile: 'roce' is not an NCCL profile"),
    ({"extra_sbatch_args": ["--time=10"]}, r"site\.extra_sbatch_args\[0\]: --time is set by"),
    ({"extra_sbatch_args": ["-C a100"]}, r"site\.extra_sbatch_args\[0\]: .*long sbatch option"),
    ({"extra_srun_args": ["--container-image=x"]}, r"site\.extra_srun_args\[0\]: .*set by"),
    ({"extra_srun_args": ["--distribution=cyclic"]},
     r"site\.extra_srun_args\[0\]: '--distribution=cyclic' is set by enn_cluster \(tasks placed"),
    ({"extra_srun_args": ["--cpu-bind=none", "-mcyclic"]}, r"site\.extra_srun_args\[1\]: .*placed"),
    ({"extra_srun_args": ["--ntasks-per-node=3"]}, r"site\.extra_srun_args\[0\]: .*placed"),
    ({"setup_lines": ["a\nb"]}, r"site\.setup_lines\[0\]: .*not one line"),
    ({"image": "docker://ubuntu"}, r"site\.image: .*drop 'docker://'"),
    ({"runs_root": "runs"}, r"site\.runs_root: .*must be absolute"),
    ({"signal_grace_s": 0}, r"site\.signal_grace_s: 0 must be >= 1"),
    ({"gpu_request": "gpus"}, r"site\.gpu_request: 'gpus' is not a way to ask for GPUs.*gres:TYPE"),
    ({"gpu_request": "gres:a 100"}, r"site\.gpu_request: 'gres:a 100' is not"),
    ({"cpus_per_task": 0}, r"site\.cpus_per_task: 0 must be >= 1; leave it out"),
    ({"socket_ifname": "eth0,ib0"}, r"site\.socket_ifname: 'eth0,ib0' is not an interface"),
    ({"cpus_per_task": "8"}, r"site\.cpus_per_task: expected a whole number"),
    (["partition"], r"site: the file must be a mapping"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(UserError, match=message):
        site.parse_site(data, "/etc/enn_cluster/site.yaml")


def test_errors_name_the_file(places):
    p, write, load = places
    p["cwd"].write_text("partition: gpu\nmounts: /a:/a\n")
    with pytest.raises(UserError, match=r"site\.mounts: .*\(in .*enn-site\.yaml\)"):
        load(flag=False, env=False)
    p["cwd"].write_text("partition: [gpu\n")
    with pytest.raises(UserError, match=r"enn-site\.yaml line \d+ is not valid YAML"):
        load(flag=False, env=False)


def test_empty_file_is_an_empty_config(places):
    p, write, load = places
    p["cwd"].write_text("# nothing yet\n")
    conf = load(flag=False, env=False)
    assert conf.overrides() == {} and conf.source == str(p["cwd"])


def test_example_file_is_valid_and_documents_every_key():
    path = ROOT / "slurm" / "site.example.yaml"
    conf = site.parse_site(yaml.safe_load(path.read_text()), str(path))
    assert set(conf.overrides()) == set(site.KEYS)


def test_site_runs_root_gpus_and_image_cache_reach_the_job(tmp_path):
    """The site's runs_root, gpus_per_node and image_cache are used where no flag or config
    key names them; with no image anywhere, the error says how to build one."""
    import shutil

    from enn_cluster.cluster.image_key import image_key, image_path
    from helpers import ROOT, cli, controller_up_scontrol, small_config, write_config

    work = tmp_path / "repo"
    (work / "containers").mkdir(parents=True)
    shutil.copy(ROOT / "containers" / "Dockerfile", work / "containers" / "Dockerfile")
    cache = tmp_path / "cache"
    runs = tmp_path / "shared-runs"
    (work / "site.yaml").write_text(yaml.safe_dump({
        "runs_root": str(runs), "image_cache": str(cache), "gpus_per_node": 4,
        "partition": "gpu"}))
    cfg = small_config(tmp_path, "fromsite")
    cfg.pop("runs_root")
    write_config(work / "run.yaml", **cfg)
    args = ("render", "run.yaml", "--site", "site.yaml", "--nodes", "2")
    missing = cli(*args, cwd=work)
    assert missing.returncode == 2 and "enn-submit build" in missing.stderr, missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    built = image_path(cache, image_key(work / "containers" / "Dockerfile", work))
    built.parent.mkdir(parents=True)
    built.write_bytes(b"hsqs")  # where `enn-submit build` puts the squashfs of these sources
    done = cli(*args, cwd=work)
    assert done.returncode == 0, done.stderr
    assert f" --container-image={built} " in done.stdout
    assert "#SBATCH --ntasks-per-node=4" in done.stdout and "#SBATCH --partition=gpu" in done.stdout
    # train: the run directory goes to the site's runs_root (the config names none)
    # (an sbatch that notes the batch script it was handed, then refuses it)
    bin_dir, handed = tmp_path / "bin", tmp_path / "handed"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {handed}\n'
                                    'echo "sbatch: error: Batch job submission failed" >&2\nexit 1\n')
    (bin_dir / "sbatch").chmod(0o755)
    controller_up_scontrol(bin_dir)
    train = cli("train", "--config", "run.yaml", "--site", "site.yaml", "--cluster", "slurm",
                "--container", "/nonexistent/enn.sqsh", "--cpus-per-task", "8", cwd=work,
                env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert train.returncode == 2, train.stderr  # refused by sbatch: nothing left
    assert str(runs / "fromsite") in handed.read_text()  # the job was made there
    assert not runs.exists() and not (work / "runs").exists()
