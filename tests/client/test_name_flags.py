"""Flags that name things are verbatim strings, --set values stay YAML, and render uses
the site's runs_root like train does."""
from __future__ import annotations

import pytest
import yaml

from enn_cluster.client.launching import load_flagged_config
from helpers import cli


@pytest.mark.parametrize("name", ["exp #3", "0010", "yes", "1.0", "null", "~", "[a]", "{a: 1}",
                                  "1e5", "0x1f", "on", "2026-11-23", "a: b", "-"])
def test_run_name_flag_is_verbatim(tmp_path, name):
    cfg = load_flagged_config(None, [], None, run_name=name, runs_root=str(tmp_path / "rr #1"))
    assert cfg.run_name == name and cfg.runs_root == str(tmp_path / "rr #1")


@pytest.mark.parametrize("value", ["1.0", "0010", "yes", "exp #3"])
def test_run_name_in_a_yaml_file_as_a_quoted_string(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run_name": value}))
    assert load_flagged_config(str(path), [], None).run_name == value


def test_set_values_stay_yaml():
    cfg = load_flagged_config(None, ["training.lr=1e-4", "training.epochs=0010"], None)
    assert cfg.training.lr == 1e-4 and cfg.training.epochs == 8  # YAML 1.1: octal


def test_render_uses_the_site_runs_root(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"runs_root": str(tmp_path / "site-runs")}))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"run_name": "r"}))
    done = cli("render", tmp_path / "c.yaml", "--container", "none", "--site", site)
    assert done.returncode == 0, done.stderr
    assert f"ENN_RUN_DIR={tmp_path / 'site-runs' / 'r'}" in done.stdout
