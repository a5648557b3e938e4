"""docs/cli.md's walk-throughs run as written: its Python blocks make the files, then each `dynemb` line of its
bash blocks runs (in-process, as `python -m dynemb` would) in the same directory, in order."""

import json
import re
import shlex
from pathlib import Path

import pytest
import pyarrow.parquet as pq

from dynemb.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


@pytest.mark.slow
def test_cli_walkthroughs_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = DOC.read_text()
    namespace = {"__name__": "__doc_snippet__"}
    commands = []
    for kind, body in re.findall(r"```(python|bash)\n(.*?)```", text, re.S):
        if kind == "python":
            exec(compile(body, str(DOC), "exec"), namespace)
        else:
            commands += [line for line in body.splitlines() if line.startswith("dynemb ")]
    assert len(commands) == 7
    outputs = {}
    for line in commands:
        args = shlex.split(line)[1:]
        assert main(args) == 0, f"{line}: {capsys.readouterr().err}"
        outputs.setdefault(args[0], []).append(capsys.readouterr().out.strip().splitlines()[-1])
    first_train = json.loads(outputs["train"][0])
    assert first_train["rows"] + first_train["samples"] // 20 == 6000  # 5% held out, 20 epochs (auto) of the rest
    assert json.loads(outputs["eval"][0])["rows"] == 6000 and json.loads(outputs["eval"][0])["auc"] > 0.65
    assert pq.read_table("scores.parquet").schema.names == ["probability"]
    assert pq.read_table("criteo_scores.parquet").num_rows == 4096
