"""`mirrord init`: a commented starter config (and unit) from the packaged copies; never clobbers a file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from mirrord import cli
from mirrord.commands.init import ALERT_RULES, EXAMPLE_CONFIG, SYSTEMD_UNIT, packaged
from mirrord.config import load_config
from mirrord.store import atomic

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def init(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    def run(*argv: str | Path) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.main(["init", *map(str, argv)])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_packaged_files_are_the_documented_ones() -> None:
    """mirrord/data/ holds the very files the README documents (links), not copies that drift."""
    for name, source in (
        (EXAMPLE_CONFIG, "config/mirrord.toml"),
        (SYSTEMD_UNIT, "systemd/mirrord.service"),
        (ALERT_RULES, "config/prometheus/alerts.yml"),
    ):
        assert packaged(name) == (REPO / source).read_text(encoding="utf-8"), name


def test_init_writes_the_commented_config_with_the_roots(
    tmp_path: Path, init: Callable[..., tuple[int, str, str]]
) -> None:
    """Every comment of the example survives; the roots are filled in; the file is a valid config."""
    (tmp_path / "ckpt").mkdir()
    target = tmp_path / "etc" / "mirrord" / "mirrord.toml"  # missing folders are created
    code, out, _err = init(target, "--primary", tmp_path / "ckpt", "--mirror", tmp_path / "backup")
    assert code == 0
    assert f"wrote {target}" in out and f"mirrord check-config --config {target}" in out
    text = target.read_text(encoding="utf-8")
    example = packaged(EXAMPLE_CONFIG)
    assert [ln for ln in text.splitlines() if ln.startswith("#")] == [
        ln for ln in example.splitlines() if ln.startswith("#") and not ln.startswith("# mirror =")
    ]
    config = load_config(target, environ={})
    assert (config.primary, config.mirror) == (tmp_path / "ckpt", tmp_path / "backup")
    assert config.prune.keep_last == 12  # the default the example's commented `# keep_last = 12` names
    assert "# keep_last = 12" in example.splitlines()
    assert oct(target.stat().st_mode & 0o777) == oct(0o644 & ~_umask())
    assert [p.name for p in target.parent.iterdir()] == ["mirrord.toml"]  # no temp file left


def test_without_mirror_the_config_says_it_must_be_set(
    tmp_path: Path, init: Callable[..., tuple[int, str, str]]
) -> None:
    """The example leaves mirror unset: running on it is the 'mirror: not set' error, never a default path."""
    code, out, _err = init(tmp_path / "mirrord.toml")
    assert code == 0 and "set mirror (required)" in out
    with pytest.raises(Exception, match="mirror: not set"):
        load_config(tmp_path / "mirrord.toml", environ={}, check_roots=False)


def test_init_never_overwrites_without_force(tmp_path: Path, init: Callable[..., tuple[int, str, str]]) -> None:
    target = tmp_path / "mirrord.toml"
    target.write_text("# mine\n")
    code, out, err = init(target, "--systemd")
    assert (code, out) == (2, "")
    assert err.strip() == f"mirrord init: {target} exists; not overwritten (--force replaces it)"
    assert target.read_text() == "# mine\n"
    assert not (tmp_path / "mirrord.service").exists()  # all or nothing: the unit was not written either
    code, out, _err = init(target, "--force", "--mirror", tmp_path / "m")
    assert code == 0 and f"replaced {target}" in out
    assert load_config(target, environ={}, check_roots=False).mirror == tmp_path / "m"


def test_init_systemd_writes_a_unit_for_this_config(tmp_path: Path, init: Callable[..., tuple[int, str, str]]) -> None:
    """The unit next to the config runs this config, on these roots; the rest is the packaged unit."""
    target = tmp_path / "mirrord.toml"
    code, out, _err = init(target, "--systemd", "--primary", tmp_path / "p", "--mirror", tmp_path / "m")
    assert code == 0 and "systemctl enable --now mirrord" in out
    unit = (tmp_path / "mirrord.service").read_text()
    lines = unit.splitlines()
    [exec_start] = [ln for ln in lines if ln.startswith("ExecStart=")]
    assert exec_start.endswith(f" run --config {target}") and exec_start.split()[0].startswith("ExecStart=/")
    assert f"RequiresMountsFor={tmp_path / 'p'} {tmp_path / 'm'}" in lines
    assert f"ReadWritePaths={tmp_path / 'm'}" in lines
    packaged_lines = packaged(SYSTEMD_UNIT).splitlines()
    changed = [a for a, b in zip(lines, packaged_lines, strict=True) if a != b]
    assert len(changed) == 3


def test_publish_without_overwrite_never_replaces_a_file_that_appeared(tmp_path: Path) -> None:
    """The no-clobber publish links instead of renaming: a file created after any check survives."""
    final = tmp_path / "mirrord.toml"
    with pytest.raises(FileExistsError), atomic.atomic_output(final, overwrite=False) as f:
        f.write(b"new")
        final.write_bytes(b"theirs")  # appears between our check and our publish
    assert final.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mirrord.toml"]
    atomic.write_bytes_atomic(tmp_path / "other.toml", b"x", overwrite=False)
    assert (tmp_path / "other.toml").read_bytes() == b"x"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
