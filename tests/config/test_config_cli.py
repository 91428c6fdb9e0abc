"""Bad input: one line naming the field and the fix, exit code 2, nothing written."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from enn_cluster.config.loading import apply_overrides, config_from_dict, load_config
from enn_cluster.config.run_config import ParallelConfig, plan_mesh
from enn_cluster.errors import UserError
from helpers import ROOT, cli, small_config, write_config


def _bad(tmp_path, *extra, **over):
    cfg = small_config(tmp_path, "bad")
    for section, values in over.items():
        cfg.setdefault(section, {}).update(values) if isinstance(values, dict) else cfg.update({section: values})
    path = write_config(tmp_path / "run.yaml", **cfg)
    res = cli("train", "--config", path, *extra, timeout=60)
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("enn-submit: error: "), res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    return lines[0]


@pytest.mark.parametrize("over, extra, needle", [
    ({"training": {"lrr": 1.0}}, (), "training.lrr: unknown key"),
    ({"training": {"epochs": "three"}}, (), "training.epochs: expected int"),
    ({"training": {"per_device_train_batch_size": 0}}, (), "training.per_device_train_batch_size"),
    ({"training": {"lr": -1.0}}, (), "training.lr"),
    ({"parallel": {"replicate": 3}}, (), "parallel.replicate, parallel.shard:"),
    ({"parallel": {"strategy": "zero3"}}, (), "parallel.strategy"),
    ({"data": {"train_path": "/nonexistent/x.npz"}}, (), "data.train_path: /nonexistent/x.npz does not exist"),
    ({"data": {"train_path": "x.csv"}}, (), "data.train_path"),
    ({}, ("--nodes", "0"), "--nodes"),
    ({}, ("--procs-per-node", "-2"), "--procs-per-node"),
    ({}, ("--set", "training.epochs=-1"), "training.epochs"),
    ({}, ("--set", "nonsense"), "--set 'nonsense'"),
    ({"training": {"per_device_train_batch_size": 4096}}, (), "exceeds the"),
    ({"model": {"name": "nope_module:factory"}}, (), "model.name"),
    ({"training": {"float8": "fast"}}, (), "training.float8"),
])
def test_bad_config_exit_2_one_line(tmp_path, over, extra, needle):
    line = _bad(tmp_path, *extra, **over)
    assert needle in line, line


def test_missing_config_file_and_bad_yaml(tmp_path):
    res = cli("train", "--config", tmp_path / "missing.yaml", timeout=60)
    assert res.returncode == 2 and "--config" in res.stderr and len(res.stderr.splitlines()) == 1
    (tmp_path / "broken.yaml").write_text("training: [unclosed\n")
    res = cli("train", "--config", tmp_path / "broken.yaml", timeout=60)
    assert res.returncode == 2 and "not valid YAML" in res.stderr


def test_existing_run_is_refused_and_kept(tmp_path):
    run = tmp_path / "runs" / "bad"
    run.mkdir(parents=True)
    (run / "keep.txt").write_text("precious")
    path = write_config(tmp_path / "run.yaml", **small_config(tmp_path, "bad"))
    res = cli("train", "--config", path, timeout=60)
    assert res.returncode == 2 and "already exists" in res.stderr
    assert (run / "keep.txt").read_text() == "precious"


def test_overrides_parse_yaml_values():
    data = apply_overrides({}, ["training.lr=1e-4", "training.bf16=false", "model.hidden_sizes=[8, 4]",
                                "run_name=x y"])
    cfg = config_from_dict(data)
    assert cfg.training.lr == 1e-4 and cfg.training.bf16 == "false"
    assert cfg.model.hidden_sizes == [8, 4] and cfg.run_name == "x y"


def test_mesh_plan_defaults_to_nodes_by_local_world():
    assert plan_mesh(ParallelConfig(), 8, 4).__dict__ == {"strategy": "hsdp", "replicate": 2, "shard": 4}
    assert plan_mesh(ParallelConfig(strategy="fsdp"), 8, 4).shard == 8
    assert plan_mesh(ParallelConfig(strategy="ddp"), 8, 4).replicate == 8
    with pytest.raises(UserError, match="does not equal the world size 8"):
        plan_mesh(ParallelConfig(shard=3), 8, 4)


def test_load_config_roundtrip(tmp_path):
    path = write_config(tmp_path / "c.yaml", **small_config(tmp_path))
    cfg = load_config(str(path), ["training.epochs=5"])
    assert cfg.training.epochs == 5 and cfg.parallel.nodes == 2
    assert yaml.safe_load(yaml.safe_dump(cfg.__dict__ and {"a": 1})) == {"a": 1}


def test_cli_help_does_not_import_torch():
    """Nor the LM libraries (transformers, peft): only `plan` and hf runs need them."""
    code = ("import sys, contextlib, io\n"
            "from enn_cluster.client import cli\n"
            "for argv in (['--help'], ['plan', '--help'], ['train', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try: cli.main(argv)\n"
            "        except SystemExit: pass\n"
            "bad = {'torch', 'transformers', 'peft'} & set(sys.modules)\n"
            "assert not bad, f'imported: {bad}'\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("value,why", [("x-3", "not a step range"), ("5-2", "forwards"),
                                        ("0-3", "from step 1"), ("1-500", "too many"),
                                        ("3-", "not a step range")])
def test_a_bad_profiling_window_is_one_line(tmp_path, value, why):
    cfg = write_config(tmp_path / "c.yaml", **small_config(tmp_path, "prof"))
    res = cli("prepare", "--config", cfg, "--set", f"profiling.steps={value}")
    assert res.returncode == 2 and "profiling.steps" in res.stderr and why in res.stderr
    assert res.stderr.strip().count("\n") == 0 and not (tmp_path / "runs").exists()


def test_test_only_faults_live_in_the_environment_not_the_config(tmp_path):
    """Issue 26 section 4: training.fail_at_step/fail_rank/oom_at_step are not config keys
    (a user's config naming one is refused like any unknown key); a run made before, whose
    config.yaml froze them, still loads; the tests' faults come from ENN_TEST_FAULTS."""
    from enn_cluster.storage.rundir import RunDir
    from enn_cluster.worker.fault_injection import Faults, test_faults

    with pytest.raises(UserError, match="training.fail_at_step: unknown key"):
        config_from_dict({"training": {"fail_at_step": 3}})
    old = config_from_dict(small_config(tmp_path, "old"))
    data = yaml.safe_load(yaml.safe_dump(__import__("dataclasses").asdict(old)))
    data["training"].update(fail_at_step=0, fail_rank=0, oom_at_step=0)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text(yaml.safe_dump(data))
    assert RunDir(tmp_path / "old").load_config() == old
    assert test_faults({}) == Faults()
    assert test_faults({"ENN_TEST_FAULTS": "fail_at_step=13, fail_rank=3"}) == \
        Faults(fail_at_step=13, fail_rank=3)
    with pytest.raises(UserError, match="ENN_TEST_FAULTS: 'fail_step=2'"):
        test_faults({"ENN_TEST_FAULTS": "fail_step=2"})


def test_float8_is_refused_with_lora_and_without_torchao(tmp_path, monkeypatch):
    """training.float8 with LoRA, or where torchao is missing: one line naming the key and
    the fix (the model and data are not read for either)."""
    import importlib.util

    from enn_cluster.client.prepare import check_model

    cfg = small_config(tmp_path, "f8")
    lm = {**cfg, "model": {"name": f"hf:{tmp_path}"}, "lora": {"r": 4},
          "training": {**cfg.get("training", {}), "float8": True}}
    with pytest.raises(UserError, match=r"training\.float8: not with LoRA .* lora\.r: 0"):
        config_from_dict(lm)
    run_cfg = config_from_dict({**cfg, "training": {**cfg.get("training", {}), "float8": True}})
    check_model(run_cfg)  # torchao is in the dev install
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else found(name, *a))
    with pytest.raises(UserError, match=r"training\.float8: needs torchao; pip install "
                                        r"'enn_cluster\[float8\]'"):
        check_model(run_cfg)
