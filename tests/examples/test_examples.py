"""Each example in examples/ runs to completion, and every Python snippet of the docs and the README runs."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from dynemb.distributed.launch import free_port

import doc_prints

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
@pytest.mark.slow
def test_example_runs(script, example_runs):
    proc = example_runs[script]
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    for expected in SCRIPTS[script]:
        assert expected in stdout, stdout


def _torchrun(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 ARGS`` on a free port. Two fresh-clone CI runs (and never a run alone, 20+
    times) saw a rank abort inside torch's C++ with "terminate called without an active exception": one more
    launch then, and only then; any other failure, or the same abort twice, is returned as it is."""
    def launch():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=cwd)

    proc = launch()
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        warnings.warn(f"torchrun {args}: a rank aborted in torch's C++; relaunched once. stdout: "
                      f"{proc.stdout[-500:]!r}", stacklevel=2)
        proc = launch()
    return proc


@pytest.mark.slow
def test_train_distributed_under_torchrun_world_2():
    proc = _torchrun(str(ROOT / "examples" / "train_distributed.py"), "--steps", "12")
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------------- docs
# A ```python block runs, in order, in one namespace per file, and what each print(...) prints must be what its
# comment shows (the convention is in doc_prints.py). A block right after <!-- not run: REASON --> is skipped (the
# reason says how it is checked instead); one right after <!-- torchrun --> runs alone under
# ``torchrun --nproc_per_node=2``, each rank checking its own prints.
_BLOCK = re.compile(r"(?:<!-- (?P<marker>not run: [^>]+|torchrun) -->\s*)?```python\n(?P<code>.*?)```", re.S)
DOCS = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def _blocks(doc: str):
    """``(number, first line in the file, marker or None, code)`` of every ```python block of ``doc``."""
    text = (ROOT / doc).read_text()
    for i, match in enumerate(_BLOCK.finditer(text)):
        yield i + 1, text.count("\n", 0, match.start("code")) + 1, match.group("marker"), match.group("code")


TORCHRUN_BLOCKS = [(doc, n) for doc in DOCS for n, _, marker, _ in _blocks(doc) if marker == "torchrun"]


def test_docs_exist():
    names = {Path(d).name for d in DOCS}
    assert {"tables.md", "training.md", "distributed.md", "checkpoint.md", "serving.md", "architecture.md"} <= names


@pytest.mark.parametrize("doc", DOCS)
@pytest.mark.slow
def test_doc_snippets_run(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace = {"__name__": "__doc_snippet__"}
    problems = []
    for number, first_line, marker, code in _blocks(doc):
        if marker is None:
            where = f"{doc} python block {number}"
            problems += doc_prints.mismatches(doc_prints.run_block(code, where, namespace), where, first_line)
    assert not problems, "\n".join(problems)


@pytest.mark.slow  # about 30 s: two ranks start torch and dynemb
@pytest.mark.parametrize("doc, number", TORCHRUN_BLOCKS, ids=[f"{d}-{n}" for d, n in TORCHRUN_BLOCKS])
def test_doc_torchrun_blocks(doc, number, tmp_path):
    assert ("docs/distributed.md", 2) in TORCHRUN_BLOCKS  # the marker is not lost in an edit of the docs
    code = next(code for n, _, _, code in _blocks(doc) if n == number)
    (tmp_path / "block.py").write_text(code)
    proc = _torchrun(str(Path(doc_prints.__file__)), "block.py", cwd=tmp_path)
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    # the two ranks write to one stderr at once: their lines can run together, so read the counts, not the lines
    checked = [int(n) for n in re.findall(r"doc prints checked: (\d+)", proc.stderr)]
    assert len(checked) == 2 and sum(checked) >= 1, proc.stderr[-3000:]  # both ranks ran it; something printed


def test_doc_print_convention():
    """A comment that disagrees with the print is named; ``...`` and ``: prose`` are allowed; prints must show."""
    code = ("print([1.25, 2])  # [1.2..., 2]: prose after the value\n"
            "print({'a': 1})\n# {'a': 1}\n"
            "print(3)  # 4\n"
            "print('no comment')\n"
            "if False:\n    print(5)  # 5\n")
    problems = doc_prints.mismatches(doc_prints.run_block(code, "t.md block", {}), "t.md block", 10)
    assert problems == ["t.md block line 13: printed '3', but its comment shows '4'",
                        "t.md block line 14: print(...) has no comment showing what it prints",
                        "t.md block line 16: print(...) never ran, so its comment '5' is unchecked"]
