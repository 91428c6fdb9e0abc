"""`enn-submit build`: the image key, Enroot's image layout, and a real podman -> squashfs build."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from enn_cluster.cluster import enroot_layout
from enn_cluster.errors import ToolMissing, UserError
from enn_cluster.cluster.image import (ENROOT_IMPORT, OWN_WRITER, builder_env, build_image,
                                       final_line, read_record, record_path, size_text)
from enn_cluster.cluster.image_key import (context_entries, find_cached_image, image_for, image_key,
                                           image_path, is_ignored, parse_dockerignore)
from pyxis_fixture import build_args

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------- .dockerignore and key

def test_dockerignore_follows_docker_rules():
    rules = parse_dockerignore("# comment\n*\n!pyproject.toml\n!enn_cluster/\n"
                               "**/__pycache__\n/docs/**/*.md\n!docs/keep.md\n")
    ignored = {path: is_ignored(path, rules) for path in [
        "pyproject.toml", "enn_cluster/image.py", "enn_cluster/sub/x.py", "tests/test_x.py",
        ".venv/bin/python", "enn_cluster/__pycache__/image.cpython-311.pyc",
        "docs/a/b/c.md", "docs/keep.md"]}
    assert ignored == {
        "pyproject.toml": False, "enn_cluster/image.py": False, "enn_cluster/sub/x.py": False,
        "tests/test_x.py": True, ".venv/bin/python": True,
        "enn_cluster/__pycache__/image.cpython-311.pyc": True,
        "docs/a/b/c.md": True, "docs/keep.md": False}
    blacklist = parse_dockerignore(".venv\nruns/\n*.log\ndata/*.np[yz]\n")
    assert is_ignored(".venv/lib/x.py", blacklist) and is_ignored("runs/a/b", blacklist)
    assert is_ignored("train.log", blacklist) and not is_ignored("sub/train.log", blacklist)
    assert is_ignored("data/x.npz", blacklist) and not is_ignored("data/x.csv", blacklist)


def _context(tmp_path: Path) -> tuple[Path, Path]:
    ctx = tmp_path / "ctx"
    (ctx / "pkg").mkdir(parents=True)
    (ctx / "tests" / "data").mkdir(parents=True)
    (ctx / "Dockerfile").write_text("FROM scratch\nCOPY pkg /pkg\n")
    (ctx / ".dockerignore").write_text("tests\n**/*.pyc\n")
    (ctx / "pkg" / "mod.py").write_text("x = 1\n")
    (ctx / "tests" / "data" / "big.bin").write_bytes(b"\0" * 10)
    return ctx / "Dockerfile", ctx


def test_key_changes_with_what_the_build_sees(tmp_path):
    dockerfile, ctx = _context(tmp_path)
    key = image_key(dockerfile, ctx)
    assert key == image_key(dockerfile, ctx)
    (ctx / "tests" / "data" / "big.bin").write_bytes(b"\1" * 10)  # ignored: same key
    (ctx / "pkg" / "mod.cpython-311.pyc").write_bytes(b"junk")
    assert image_key(dockerfile, ctx) == key
    (ctx / "pkg" / "mod.py").write_text("x = 2\n")
    changed = image_key(dockerfile, ctx)
    assert changed != key
    (ctx / "pkg" / "mod.py").chmod(0o755)  # COPY keeps the exec bit
    assert image_key(dockerfile, ctx) != changed
    assert image_key(dockerfile, ctx, {"BASE_IMAGE": "a"}) != image_key(dockerfile, ctx)
    dockerfile.write_text("FROM scratch\nCOPY pkg /opt/pkg\n")
    assert image_key(dockerfile, ctx) not in (key, changed)


def test_repo_context_is_only_the_package_and_its_metadata():
    """The repo's .dockerignore keeps venvs, runs, tests and caches out of the image key."""
    paths = [rel for rel, _ in context_entries(ROOT)]
    assert {"pyproject.toml", "README.md", "enn_cluster/__init__.py"} <= set(paths)
    assert all(p in ("pyproject.toml", "README.md") or p.startswith("enn_cluster") for p in paths)
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in paths)


def test_cached_image_lookup(tmp_path):
    dockerfile, ctx = _context(tmp_path)
    cache = tmp_path / "cache"
    expected = image_path(cache, image_key(dockerfile, ctx))
    assert expected.parent == cache and expected.name.startswith("enn-")
    assert len(expected.name) == len("enn-.sqsh") + 16
    assert find_cached_image(dockerfile, ctx, cache) is None
    with pytest.raises(UserError, match="enn-submit build"):
        image_for(dockerfile, ctx, cache)
    cache.mkdir()
    expected.touch()
    assert image_for(dockerfile, ctx, cache) == expected


def test_build_returns_cached_image_without_tools(tmp_path, monkeypatch):
    dockerfile, ctx = _context(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ToolMissing, match="apt-get install podman"):
        build_image(dockerfile, ctx, cache, progress=lambda line: None)
    cache.mkdir()
    expected = image_path(cache, image_key(dockerfile, ctx))
    expected.touch()
    lines = []
    assert build_image(dockerfile, ctx, cache, progress=lines.append) == expected
    assert lines[-1] == f"enn build: up to date: {expected} (0 bytes, how it was made is not recorded)"


def test_final_line_names_image_size_and_writer():
    image = Path("/c/enn-0123456789abcdef.sqsh")
    assert final_line(image, 416_123_456, OWN_WRITER, 95.34) == (
        f"enn build: wrote {image} (416 MB, made by our own writer, 95.3s in all)")
    assert final_line(image, 2_345_000_000, ENROOT_IMPORT) == (
        f"enn build: up to date: {image} (2.3 GB, made by enroot import)")
    assert size_text(999_999) == "999999 bytes"


def test_a_bad_build_record_reads_as_unrecorded(tmp_path):
    image = tmp_path / "enn-0123456789abcdef.sqsh"
    for text in ("", "[1]", '{"writer": "rm -rf"}', "{" * 10_000):
        record_path(image).write_text(text)
        assert read_record(image) is None
    record_path(image).write_text('{"writer": "enroot import"}')
    assert read_record(image) == ENROOT_IMPORT
    real = tmp_path / "elsewhere.json"
    real.write_text('{"writer": "enroot import"}')
    big = '{"writer": "enroot import", "x": "' + "y" * 5000 + '"}'
    makers = (os.mkfifo, Path.mkdir, lambda p: p.symlink_to(real), lambda p: p.write_text(big))
    for i, make in enumerate(makers):
        other = tmp_path / f"enn-{i}.sqsh"  # a fresh image name for each
        make(record_path(other))  # a FIFO must not hang the build, a link not be followed
        assert read_record(other) is None


FAKE_PODMAN = """#!/bin/sh
echo "podman $*" >> "$FAKE_LOG"
[ "$1 $2" = "image inspect" ] && echo "[{\\"Config\\": $FAKE_CONFIG}]"
[ "$1" = export ] && tar -cf - -T /dev/null
exit 0
"""
FAKE_MKSQUASHFS = """#!/bin/sh
echo "mksquashfs $*" >> "$FAKE_LOG"
echo squashed > "$2"
"""
FAKE_ENROOT = """#!/bin/sh
echo "enroot $* $ENROOT_SQUASH_OPTIONS" >> "$FAKE_LOG"
[ "$FAKE_ENROOT_RC" = 0 ] && echo image > "$3"
exit "$FAKE_ENROOT_RC"
"""


@pytest.mark.parametrize("enroot_rc", [0, 1])
def test_build_uses_enroot_import_when_installed(tmp_path, monkeypatch, enroot_rc):
    """With enroot on PATH: podman build, `enroot import podman://TAG`, rmi; atomic output."""
    dockerfile, ctx = _context(tmp_path)
    bin_dir, log, cache = tmp_path / "bin", tmp_path / "log", tmp_path / "cache"
    _fake_tools(bin_dir, monkeypatch, log, '{"Cmd": ["/bin/sh"]}')
    monkeypatch.setenv("FAKE_ENROOT_RC", str(enroot_rc))
    monkeypatch.delenv("ENROOT_SQUASH_OPTIONS", raising=False)
    final = image_path(cache, image_key(dockerfile, ctx, {"A": "b c"}))
    lines = []
    if enroot_rc:
        with pytest.raises(UserError, match="enroot import"):
            build_image(dockerfile, ctx, cache, build_args={"A": "b c"}, progress=lines.append)
        assert not cache.exists()  # the failed build made the cache folder: gone again
        assert _stages(lines) == ["hash build context", "podman build", "inspect image config",
                                  "podman rmi (the build's image)"]
    else:
        assert build_image(dockerfile, ctx, cache, build_args={"A": "b c"},
                           progress=lines.append) == final
        assert final.read_text() == "image\n"
        assert sorted(cache.iterdir()) == [final, record_path(final)]
        assert _stages(lines) == ["hash build context", "podman build", "inspect image config",
                                  "enroot import", "podman rmi (the build's image)"]
        assert lines[-1].startswith(f"enn build: wrote {final} (6 bytes, made by enroot import, ")
    build, inspect, enroot, rmi = log.read_text().splitlines()
    tag = build.split(" -t ")[1].split()[0]
    assert tag.startswith(f"localhost/enn-cluster:{final.stem[4:]}-")
    assert build == f"podman build --force-rm -f {dockerfile} -t {tag} --build-arg=A=b c {ctx}"
    assert inspect == f"podman image inspect {tag}"
    partial = enroot.split()[3]
    assert Path(partial).parent == cache and partial.endswith(".partial")
    assert enroot.endswith(f"podman://{tag} -comp zstd -Xcompression-level 3")
    assert rmi == f"podman rmi -f {tag}"


def test_own_writer_build_says_each_stage_cleanup_included(tmp_path, monkeypatch):
    """An image without CMD goes through our writer: each step, the removal of the export
    container, of the rootfs and of the build's tag, prints a timed line; the last line
    names the writer, and so does the line of a later build that finds the image."""
    dockerfile, ctx = _context(tmp_path)
    bin_dir, log, cache = tmp_path / "bin", tmp_path / "log", tmp_path / "cache"
    _fake_tools(bin_dir, monkeypatch, log, "{}")
    (bin_dir / "mksquashfs").write_text(FAKE_MKSQUASHFS)
    (bin_dir / "mksquashfs").chmod(0o755)
    lines = []
    final = build_image(dockerfile, ctx, cache, progress=lines.append)
    documented = _documented_build_lines()  # admin.md's sample, from a real build
    assert _stages(lines) == _stages(documented) == [
        "hash build context", "podman build", "inspect image config", "export rootfs",
        "podman rm (the export container)", "write Enroot files", "mksquashfs (zstd -3)",
        "remove rootfs", "podman rmi (the build's image)"]
    assert lines[3] == documented[3]  # the line saying why not enroot import
    image, mb, seconds = re.fullmatch(r"enn build: wrote (.+) \((\d+) MB, .*, ([\d.]+)s in all\)",
                                      documented[-1]).groups()
    assert documented[-1] == final_line(Path(image), int(mb) * 10**6, OWN_WRITER, float(seconds))
    assert lines[-1].startswith(f"enn build: wrote {final} (9 bytes, made by our own writer, ")
    (squash,) = [line for line in log.read_text().splitlines() if line.startswith("mksquashfs")]
    assert "-all-root -comp zstd -Xcompression-level 3" in squash
    again = []
    assert build_image(dockerfile, ctx, cache, progress=again.append) == final
    assert again[-1] == f"enn build: up to date: {final} (9 bytes, made by our own writer)"


def _fake_tools(bin_dir: Path, monkeypatch, log: Path, config: str) -> None:
    """podman and enroot that log their arguments; `image inspect` answers `config`."""
    bin_dir.mkdir()
    for name, text in (("podman", FAKE_PODMAN), ("enroot", FAKE_ENROOT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_CONFIG", config)


def _documented_build_lines() -> list[str]:
    """The sample output of a build in docs/admin.md (the own writer's path)."""
    text = (ROOT / "docs" / "admin.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"^```\n(enn build: .*?)^```", text, re.S | re.M)
    return block.splitlines()


def _stages(lines: list[str]) -> list[str]:
    """The stage names of `enn build: NAME (1.2s)` lines, in order."""
    return [m.group(1) for line in lines
            if (m := re.fullmatch(r"enn build: (.+) \(\d+\.\ds\)", line))]


def test_podman_gets_our_containers_conf_unless_the_user_set_one():
    conf = ROOT / "containers" / "containers.conf"
    assert builder_env("podman", {}, conf)["CONTAINERS_CONF"] == str(conf)
    assert builder_env("podman", {"CONTAINERS_CONF": "/x"}, conf)["CONTAINERS_CONF"] == "/x"
    assert "CONTAINERS_CONF" not in builder_env("docker", {}, conf)
    assert "runtime = \"runc\"" in conf.read_text()


# ------------------------------------------------------------------------ Enroot's layout

CONFIG = {
    "Env": ["PATH=/usr/bin:/bin", "PYTHONUNBUFFERED=1"],
    "WorkingDir": "/workspace",
    "Entrypoint": ["/opt/entry.sh", "it's"],
    "Cmd": ["python3", "-c", "print(1)"],
    "Volumes": {"/data": {}, "/scratch": {}},
    "Labels": {"maintainer": "ml team", "version": "1"},
}


def test_enroot_rc_matches_enroot_layout():
    assert enroot_layout.rc_text(CONFIG, "podman://localhost/x:1") == (
        "# enroot-provenance: podman://localhost/x:1\n"
        "# maintainer ml team\n"
        "# version 1\n"
        "\n"
        'mkdir -p "/workspace" 2> /dev/null\n'
        'cd "/workspace" && unset OLDPWD || exit 1\n'
        "\n"
        "if [ -s /etc/rc.local ]; then\n"
        "    . /etc/rc.local\n"
        "fi\n"
        "\n"
        "if [ $# -gt 0 ]; then\n"
        "    exec '/opt/entry.sh' 'it'\\''s' \"$@\"\n"
        "else\n"
        "    exec '/opt/entry.sh' 'it'\\''s' 'python3' '-c' 'print(1)'\n"
        "fi\n")


def test_enroot_rc_without_config_runs_a_shell_in_root():
    rc = enroot_layout.rc_text({})
    assert rc.startswith('mkdir -p "/" 2> /dev/null\ncd "/" && unset OLDPWD || exit 1\n')
    assert "    exec  \"$@\"\n" in rc and "    exec  '/bin/sh'\n" in rc


def test_enroot_environment_fstab_and_rc_local():
    files = enroot_layout.enroot_files(CONFIG)
    assert set(files) == {"etc/rc", "etc/rc.local", "etc/environment", "etc/fstab"}
    assert files["etc/environment"] == "PATH=/usr/bin:/bin\nPYTHONUNBUFFERED=1\n"
    assert files["etc/fstab"] == (
        "${ENROOT_ROOTFS}/data /data none x-create=dir,bind,rw,nosuid,nodev\n"
        "${ENROOT_ROOTFS}/scratch /scratch none x-create=dir,bind,rw,nosuid,nodev\n")
    assert files["etc/rc.local"].startswith("# This file is sourced by /etc/rc")
    assert enroot_layout.enroot_files({})["etc/fstab"] == ""
    assert enroot_layout.image_config({"Config": {"Env": ["A=1"]}}) == {"Env": ["A=1"]}


def test_rc_runs_under_sh(tmp_path):
    """The generated rc is valid shell: it cds to WORKDIR and execs ENTRYPOINT + arguments."""
    if os.path.getsize("/etc/rc.local") if os.path.exists("/etc/rc.local") else 0:
        pytest.skip("the rc would source this host's /etc/rc.local")
    rc = tmp_path / "rc"
    rc.write_text(enroot_layout.rc_text({"WorkingDir": str(tmp_path / "wd"),
                                         "Entrypoint": ["echo", "a b"], "Cmd": ["default"]}))
    run = subprocess.run(["sh", str(rc)], capture_output=True, text=True, check=True)
    assert run.stdout == "a b default\n"
    run = subprocess.run(["sh", str(rc), "x", "$HOME"], capture_output=True, text=True, check=True)
    assert run.stdout == "a b x $HOME\n"
    assert (tmp_path / "wd").is_dir()


def test_bash_quote_matches_bash():
    words = ["abc", "it's", "", "a b", "a\nb", "t\tx", "$HOME", "é", "\x01", "\\", "a'b\nc"]
    for word in words:
        bash = subprocess.run(["bash", "-c", 'printf %s "${1@Q}"', "_", word],
                              capture_output=True, text=True, check=True,
                              env={"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"})
        assert enroot_layout.bash_quote(word) == bash.stdout, word


# ------------------------------------------------------------------- real build (podman)

def _podman(*args: str) -> subprocess.CompletedProcess:
    env = builder_env("podman", os.environ, ROOT / "containers" / "containers.conf")
    return subprocess.run(["podman", *args], env=env, capture_output=True, text=True)


@pytest.mark.podman
def test_build_image_makes_an_enroot_squashfs(tmp_path, test_image_build, dev_base_image):
    """The session's image: admin.md's offline build (`enn-submit build` over the dev base,
    with its PIP_INSTALL_FLAGS). That base has no CMD, which `enroot import` cannot take, so
    where enroot is installed our own writer made it; each stage said so with its time."""
    (sqsh, log), args = test_image_build, build_args(dev_base_image)
    assert sqsh == image_path(sqsh.parent, image_key(ROOT / "containers/Dockerfile", ROOT, args))
    size = size_text(sqsh.stat().st_size)
    if "enn build: up to date" in log:  # built by an earlier session
        assert f"enn build: up to date: {sqsh} ({size}, made by our own writer)" in log, log
    else:  # admin.md's sample; "inspect image config" only decides for enroot import
        documented = _stages(_documented_build_lines())
        if not shutil.which("enroot"):
            documented.remove("inspect image config")
        assert _stages(log.splitlines()) == documented, log
        assert f"enn build: wrote {sqsh} ({size}, made by our own writer, " in log, log
    assert not list(sqsh.parent.glob(f".{sqsh.name}.*"))  # no partial files left
    lines = []
    listing = subprocess.run(["unsquashfs", "-lls", str(sqsh)], capture_output=True,
                             text=True, check=True).stdout.splitlines()
    entries = {line.split()[-1] if "->" not in line else line.split()[-3]: line.split()[1]
               for line in listing if "squashfs-root" in line}
    names = {name.removeprefix("squashfs-root") or "/" for name in entries}
    assert {"/etc/rc", "/etc/rc.local", "/etc/environment", "/etc/fstab", "/workspace"} <= names
    assert not [n for n in names if n.startswith("/dev/")] and "/.dockerenv" not in names
    assert set(entries.values()) == {"root/root"}
    assert any(n.endswith("-packages/enn_cluster/cluster/image.py") for n in names)

    rc = _cat(sqsh, "etc/rc")
    assert rc.startswith(f"# enroot-provenance: podman://localhost/enn-cluster:{sqsh.stem[4:]}")
    assert 'cd "/workspace" && unset OLDPWD || exit 1' in rc
    assert "# org.opencontainers.image.title enn_cluster" in rc
    assert "PYTHONUNBUFFERED=1\n" in _cat(sqsh, "etc/environment")
    tag = rc.splitlines()[0].split("podman://")[1]
    assert _podman("image", "exists", tag).returncode == 1, f"{tag} was not removed"

    rootfs = tmp_path / "rootfs"  # mounted read-only as Pyxis does with use_squashfuse=1
    rootfs.mkdir()
    subprocess.run(["squashfuse", str(sqsh), str(rootfs)], check=True, capture_output=True)
    try:
        chroot = shutil.which("chroot", path="/usr/sbin:/usr/bin:/sbin:/bin")
        run = subprocess.run([chroot, str(rootfs), "/bin/sh", "/etc/rc", "python3", "-c",
                              "import os, enn_cluster; print(os.getcwd(), enn_cluster.__file__)"],
                             capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    finally:
        subprocess.run(["fusermount", "-u", str(rootfs)], capture_output=True)
    assert run.returncode == 0, run.stderr
    cwd, module = run.stdout.split()
    assert cwd == "/workspace" and "-packages/enn_cluster/" in module

    start = time.monotonic()
    again = build_image(ROOT / "containers/Dockerfile", ROOT, sqsh.parent, build_args=args,
                        progress=lines.append)
    assert again == sqsh and time.monotonic() - start < 2
    assert lines[-1] == f"enn build: up to date: {sqsh} ({size}, made by our own writer)"


def _cat(sqsh: Path, path: str) -> str:
    return subprocess.run(["unsquashfs", "-cat", str(sqsh), path], capture_output=True,
                          text=True, check=True).stdout
