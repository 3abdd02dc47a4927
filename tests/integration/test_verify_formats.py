"""`mirrord verify --deep` on what the training libraries write: each file judged by its own format."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.cli import run_mirrord
from tests.support.folders import write_dcp


def test_verify_deep_judges_library_files_by_their_format(tmp_path: Path) -> None:
    """safetensors, JSON and torch.save files mirrored by sync are ok under --deep (none is called a broken
    zip); a .distcp mirrored without the .metadata beside it is what dcp.load cannot read: truncated."""
    from safetensors.torch import save_file

    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    ckpt = primary / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    save_file({"w": torch.randn(64, 8), "b": torch.zeros(8)}, ckpt / "model.safetensors")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": []}))
    torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
    write_dcp(primary / "run" / "step_4", 4)
    env = {
        "MIRRORD_COPY__SETTLE_SECONDS": "0",
        "MIRRORD_METRICS__ENABLED": "false",
        "MIRRORD_PATTERNS": "*.safetensors,*.json,*.pt,*.distcp",
    }
    sync = run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env)
    assert sync.returncode == 0, sync.stderr
    deep = run_mirrord("verify", "--deep", "--json", "--mirror", mirror, env=env)
    doc = json.loads(deep.stdout)
    problems = {f["path"]: f["problem"] for f in doc["problems"]}
    assert problems == {"run/step_4/__0_0.distcp": "truncated"}, deep.stdout
    assert deep.returncode == 1
    # with its .metadata beside it (what the dcp layout mirrors), the data file is checked against it
    (mirror / "run" / "step_4" / ".metadata").write_bytes((primary / "run" / "step_4" / ".metadata").read_bytes())
    clean = run_mirrord("verify", "--deep", "--json", "--mirror", mirror, env=env)
    assert clean.returncode == 0, clean.stdout
    assert json.loads(clean.stdout)["problems"] == []


def test_verify_json_says_ok_when_it_exits_0_with_unchecked_files(tmp_path: Path) -> None:
    """A format no validator reads is reported as unchecked under --deep, never as a problem: exit 0, and the
    document's `ok` says the same (every --json document: ok exactly when the exit status is 0)."""
    primary, mirror = tmp_path / "primary", tmp_path / "mirror"
    (primary / "run").mkdir(parents=True)
    (primary / "run" / "step_1.bin").write_bytes(b"no format mirrord knows" * 100)
    env = {"MIRRORD_COPY__SETTLE_SECONDS": "0", "MIRRORD_METRICS__ENABLED": "false", "MIRRORD_PATTERNS": "*.bin"}
    assert run_mirrord("sync", "--primary", primary, "--mirror", mirror, env=env).returncode == 0
    deep = run_mirrord("verify", "--deep", "--json", "--mirror", mirror, env=env)
    doc = json.loads(deep.stdout)
    assert [f["problem"] for f in doc["problems"]] == ["unchecked"], deep.stdout
    assert (deep.returncode, doc["ok"]) == (0, True), deep.stdout
