"""The reshaping of the runner, speculative/ and the settings (issue #77) changed no output: the
configurations of equivalence_outputs.py give the same tokens, log-probabilities, exit layers and
metrics with this tree's eecore as with the tree before it (BASELINE), run side by side on this
machine with this build's compiled ops (the reshaping changed Python only, and nothing in the ops'
signatures). Skipped where the repository's history is not at hand (an installed copy)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pytest

import eecore
from model_factory import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "7ef1dcc"  # the last commit before the reshaping
SCRIPT = Path(__file__).with_name("equivalence_outputs.py")


def _baseline_package(folder: Path) -> Path:
    """BASELINE's python/eecore under `folder`, with this build's compiled extension."""
    try:
        archive = subprocess.run(["git", "archive", BASELINE, "python/eecore"], cwd=ROOT, capture_output=True,
                                 check=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"needs the repository's history (git archive {BASELINE})")
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # (Python 3.10's tarfile has no filters; the archive is our own)
            tar.extractall(folder, filter="data")
        else:
            tar.extractall(folder)
    compiled = Path(eecore._C.__file__)
    shutil.copy(compiled, folder / "python" / "eecore" / compiled.name)
    return folder / "python"


def _outputs(python_path: Path, model: str, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(python_path), str(SCRIPT.parent)]))
    done = subprocess.run([sys.executable, str(SCRIPT), model, str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_the_reshaping_changed_no_output(tmp_path):
    baseline = _baseline_package(tmp_path / "baseline")
    model, _ = make_tiny_hf_model(tmp_path / "tiny", num_layers=4)
    before = _outputs(baseline, str(model), tmp_path / "before.json")
    after = _outputs(Path(eecore.__file__).parents[1], str(model), tmp_path / "after.json")
    assert len(after) >= 12
    assert before.keys() == after.keys()
    for name in after:
        assert after[name] == before[name], name
