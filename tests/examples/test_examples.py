"""Each example in examples/ runs to completion, and every Python snippet of the docs and the README runs."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dynemb.distributed.launch import free_port

ROOT = Path(__file__).resolve().parents[2]

# Example script -> lines its output must contain.
SCRIPTS = {
    "quickstart.py": ["loss: first 20 steps", "table: 2000 rows (max 2000)", "serving export written to"],
    "collection.py": ["'tag_b': 'DynamicEmbedding'", "history   -> Jagged(", "tag_b export: 10 ids torch.int32"],
    "checkpoint_resume.py": ["resumed run equals uninterrupted run: True",
                             "resume from the incremental checkpoint equals it too: True"],
    "serve.py": ["equal to training lookups", "served rows equal the newly trained ones"],
}
TORCHRUN = {"train_distributed.py"}


def test_every_example_has_a_test():
    assert {p.name for p in (ROOT / "examples").glob("*.py")} == set(SCRIPTS) | TORCHRUN


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Start every example script at once (one torch thread each); most of each run is Python start-up."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {script: subprocess.Popen([sys.executable, str(ROOT / "examples" / script)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env,
                                      cwd=tmp_path_factory.mktemp(script.removesuffix(".py")))
             for script in SCRIPTS}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_runs(script, example_runs):
    proc = example_runs[script]
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    for expected in SCRIPTS[script]:
        assert expected in stdout, stdout


def _torchrun_example():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(ROOT / "examples" / "train_distributed.py"), "--steps", "12"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)


def test_train_distributed_under_torchrun_world_2():
    proc = _torchrun_example()
    # Two fresh-clone CI runs (and never a run alone, 20+ times) saw a rank abort inside torch's C++ with
    # "terminate called without an active exception": one more launch then, and only then; any other failure,
    # or the same abort twice, fails the test.
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        warnings.warn(f"torchrun example: a rank aborted in torch's C++; relaunched once. stdout: "
                      f"{proc.stdout[-500:]!r}")
        proc = _torchrun_example()
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------------- docs
# A ```python block runs, in order, in one namespace per file. A block right after the comment
# <!-- not run: REASON --> is skipped (code that needs torchrun); the reason must say how it is checked instead.
_BLOCK = re.compile(r"(<!-- not run: [^>]+-->\s*)?```python\n(.*?)```", re.S)
DOCS = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def test_docs_exist():
    names = {Path(d).name for d in DOCS}
    assert {"tables.md", "training.md", "distributed.md", "checkpoint.md", "serving.md", "architecture.md"} <= names


@pytest.mark.parametrize("doc", DOCS)
def test_doc_snippets_run(doc, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace = {"__name__": "__doc_snippet__"}
    for i, match in enumerate(_BLOCK.finditer((ROOT / doc).read_text())):
        if match.group(1):
            continue
        code = compile(match.group(2), f"{doc} python block {i + 1}", "exec")
        exec(code, namespace)  # noqa: S102 - our own docs
