"""The documentation cannot drift from the code: the strict MkDocs build passes (a broken link or anchor
fails it), and every shell block of the README's quick starts runs, as written, against a real daemon
(and for S3 a real SeaweedFS on the ports the quick start names), in a temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import run_mirrord
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# The ports `weed server` takes with the quick start's flags: S3, master, volume, filer, and their gRPC.
WEED_PORTS = (8333, 9333, 8080, 8888, 18333, 19333, 18080, 18888)


def shell_blocks(markdown: str, heading: str) -> list[str]:
    """The ```sh blocks of the `## heading` section, in order."""
    sections = re.split(r"^## ", markdown, flags=re.MULTILINE)
    section = next((s for s in sections if s.startswith(heading + "\n")), None)
    assert section is not None, f"README has no section '## {heading}'"
    blocks = re.findall(r"^```sh\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)
    assert blocks, f"'## {heading}' has no shell block"
    return blocks


def _port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def quick_start(workdir: Path, heading: str, env: dict[str, str]) -> Iterator[subprocess.CompletedProcess[str]]:
    """Run the section's blocks in one `bash -e` (as typed into one terminal) in its own process group,
    which is killed afterwards whatever happened (the background daemon, weed)."""
    script = "\n".join(shell_blocks(README.read_text(), heading))
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=workdir,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
        yield subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIRRORD_", "AWS_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # Documented override (variables beat the file): a free port instead of 9108, which may be taken here.
    env["MIRRORD_METRICS__ADDRESS"] = f"127.0.0.1:{free_port()}"
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    return env


def _logs(workdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(workdir.glob("*.log")))


def test_mkdocs_strict_build_passes(tmp_path: Path) -> None:
    """`mkdocs build --strict` (links and anchors validated: mkdocs.yml) succeeds on the docs as they are."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_local_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The local quick start: daemon mirrors a torch trainer; the primary is deleted; the trainer resumes
    from the mirror's newest verified step."""
    with quick_start(tmp_path, "Quick start: a local mirror", _env()) as result:
        assert result.returncode == 0, result.stdout + _logs(tmp_path)
        assert f"{tmp_path}/mirror/run_a/step_0002.pt" in result.stdout
        assert "resumed from mirror/run_a/step_0002.pt at step 3" in result.stdout, result.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run_a").iterdir()) == [
        "step_0003.pt",
        "step_0004.pt",
        "step_0005.pt",
    ]
    # What the README says the quick start's daemon keeps is what its config has (issue 45.3).
    claimed = re.search(r"keeps the (\d+) newest verified steps", README.read_text())
    shown = run_mirrord("check-config", "--config", "mirrord.toml", "--format", "json", cwd=tmp_path)
    assert claimed is not None and int(claimed[1]) == json.loads(shown.stdout)["prune"]["keep_last"]


def test_s3_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The S3 quick start, after the local one (it reuses train.py): a real SeaweedFS, the bucket made,
    a daemon mirroring into s3://, verify, and a trainer resuming from the object `latest` names."""
    taken = [p for p in WEED_PORTS if _port_taken(p)]
    if taken:
        pytest.fail(f"the S3 quick start's ports are taken here: {taken}")
    env = _env()
    with quick_start(tmp_path, "Quick start: a local mirror", env) as local:
        assert local.returncode == 0, local.stdout + _logs(tmp_path)
    with quick_start(tmp_path, "Quick start: an S3 mirror", env) as result:
        assert result.returncode == 0, result.stdout + _logs(tmp_path)
        assert "bucket ckpts is ready" in result.stdout
        assert "resumed from restored/run_a/step_0002.pt at step 3" in result.stdout, result.stdout


def test_every_docs_page_cited_exists() -> None:
    """README links and every `docs/NAME.md` cited by the example config, the code or the deployment
    files name a page that exists (the config once cited a README section that did not)."""
    cited: set[str] = set()
    for path in [
        README,
        *REPO.glob("config/**/*"),
        *REPO.glob("mirrord/**/*.py"),
        REPO / "systemd" / "mirrord.service",
        REPO / "Dockerfile",
    ]:
        if path.is_file():
            cited.update(re.findall(r"\bdocs/[\w-]+\.md", path.read_text(errors="replace")))
    cited.update(f"docs/{m}" for m in re.findall(r"\]\(docs/([\w-]+\.md)", README.read_text()))
    assert "docs/layouts.md" in cited
    missing = sorted(c for c in cited if not (REPO / c).is_file())
    assert not missing, f"cited but absent: {missing}"


def test_the_readme_reads_once_and_resumes_from_s3_with_restore() -> None:
    """No section twice; the S3 quick start resumes with `mirrord restore`, not hand-written boto3; the docs
    build it names has an extra of its own (issue 45.8)."""
    headings = re.findall(r"^## (.+)$", README.read_text(), flags=re.MULTILINE)
    assert len(headings) == len(set(headings)), headings
    s3 = "\n".join(shell_blocks(README.read_text(), "Quick start: an S3 mirror"))
    assert "mirrord restore --config mirrord-s3.toml" in s3 and "download_file" not in s3
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [r for r in extras["docs"] if r.startswith("mkdocs")] == [
        r for r in extras["test"] if r.startswith("mkdocs")
    ]


def test_the_packages_make_test_installs_are_the_ones_the_docs_list() -> None:
    """Every Debian package `.ci/run` apt-installs is named in docs/testing.md, the README says `make test`
    installs system packages as root, and its tier table gives no test counts that go stale (issue 45.7)."""
    loop = re.search(r"for pkg in (.*?); do", (REPO / ".ci" / "run").read_text(), flags=re.DOTALL)
    assert loop is not None
    packages = loop[1].replace("\\\n", " ").split()
    testing = (REPO / "docs" / "testing.md").read_text()
    assert [p for p in packages if not re.search(rf"\b{re.escape(p)}\b", testing)] == []
    readme = README.read_text()
    assert "`make test` first apt-installs the system packages" in readme
    assert re.findall(r"\d+ (?:tests|passed)\b", readme) == []
