"""``--positive-label``: string and boolean labels, kept in the model card and applied by eval, predict and resume."""

import json

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from dynemb.cli import main
from dynemb.job import read_card

from .test_score import clicks

SMALL = ["--epochs", "2", "--batch-size", "128", "--dim", "4", "--no-progress"]
COLUMNS = ["--categorical", "user,item", "--dense", "price"]


def _relabel(table: pa.Table, values: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index("click"), "click", values)


def _texts(table: pa.Table, yes: str, no: str) -> pa.Array:
    return pa.array([yes if c else no for c in table.column("click").to_pylist()])


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.slow
def test_string_labels_train_exactly_as_their_0_1_form(tmp_path, dynemb, fmt):
    table = clicks(0, rows=800).drop_columns(["tags"])
    write = pq.write_table if fmt == "parquet" else pcsv.write_csv
    write(table, tmp_path / f"ints.{fmt}")
    write(_relabel(table, _texts(table, ">50K", "<=50K")), tmp_path / f"text.{fmt}")
    common = ["--label", "click", *COLUMNS, *SMALL]
    ints = dynemb("train", "--data", tmp_path / f"ints.{fmt}", "--out", tmp_path / "ints", *common)
    text = dynemb("train", "--data", tmp_path / f"text.{fmt}", "--out", tmp_path / "text", *common,
                  "--positive-label", ">50K")
    assert (text["auc"], text["logloss"], text["step"]) == (ints["auc"], ints["logloss"], ints["step"])
    assert read_card(tmp_path / "text").data["positive_label"] == ">50K"
    assert read_card(tmp_path / "ints").data["positive_label"] is None
    # eval applies the run's positive label to a file of text labels; predict writes the label as 0/1
    on_text = dynemb("eval", "--model", tmp_path / "text", "--data", tmp_path / f"text.{fmt}")
    assert on_text == dynemb("eval", "--model", tmp_path / "ints", "--data", tmp_path / f"ints.{fmt}")
    dynemb("predict", "--model", tmp_path / "text", "--data", tmp_path / f"text.{fmt}", "--out", tmp_path / "p.csv")
    assert pcsv.read_csv(tmp_path / "p.csv").column("click").to_pylist() == table.column("click").to_pylist()


@pytest.mark.slow
def test_boolean_labels_need_no_positive_label(tmp_path, dynemb):
    table = clicks(0, rows=800).drop_columns(["tags"])
    pq.write_table(table, tmp_path / "ints.parquet")
    pq.write_table(_relabel(table, pa.array([bool(c) for c in table.column("click").to_pylist()])),
                   tmp_path / "bools.parquet")
    common = ["--label", "click", *COLUMNS, *SMALL]
    ints = dynemb("train", "--data", tmp_path / "ints.parquet", "--out", tmp_path / "ints", *common)
    bools = dynemb("train", "--data", tmp_path / "bools.parquet", "--out", tmp_path / "bools", *common)
    also = dynemb("train", "--data", tmp_path / "bools.parquet", "--out", tmp_path / "also", *common,
                  "--positive-label", "true")
    assert ints["logloss"] == bools["logloss"] == also["logloss"]


def test_label_errors_say_what_to_do(tmp_path, capsys):
    table = clicks(0, rows=300).drop_columns(["tags"])
    pq.write_table(_relabel(table, _texts(table, "yes", "no")), tmp_path / "yes.parquet")
    common = ["train", "--data", str(tmp_path / "yes.parquet"), "--label", "click", *COLUMNS, *SMALL]
    assert main([*common, "--out", str(tmp_path / "a")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "labels must be 0 or 1" in line and "--positive-label VALUE" in line, line
    assert main([*common, "--out", str(tmp_path / "b"), "--positive-label", "Yes"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dynemb train: error: --positive-label 'Yes': no label in the first") and \
        "compared as text, exactly" in line, line
    assert not (tmp_path / "b").exists()
    nulls = _relabel(table, pa.array([None if i == 7 else "yes" for i in range(table.num_rows)]))
    pq.write_table(nulls, tmp_path / "nulls.parquet")
    assert main(["train", "--data", str(tmp_path / "nulls.parquet"), "--label", "click", *COLUMNS, *SMALL, "--out",
                 str(tmp_path / "c"), "--positive-label", "yes"]) == 2
    assert "labels must not be null, got None at row 7" in capsys.readouterr().err


def test_resume_keeps_the_positive_label(tmp_path, dynemb, capsys):
    table = clicks(0, rows=600).drop_columns(["tags"])
    pq.write_table(_relabel(table, _texts(table, "yes", "no")), tmp_path / "yes.parquet")
    run = tmp_path / "run"
    common = ["train", "--data", tmp_path / "yes.parquet", "--label", "click", *COLUMNS, "--batch-size", "128",
              "--dim", "4", "--no-progress", "--out", run]
    dynemb(*common, "--steps", "2", "--positive-label", "yes")
    assert dynemb(*common, "--steps", "4", "--resume")["step"] == 4  # the card's label, not "must be 0 or 1"
    assert main([*map(str, common), "--steps", "5", "--resume", "--positive-label", "no"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--positive-label 'no' contradicts the run being resumed" in line and "'yes'" in line, line
    assert json.loads((run / "model.json").read_text())["data"]["positive_label"] == "yes"
    assert "warning" not in capsys.readouterr().err  # its labels are 'yes'/'no': nothing to say
    pq.write_table(_relabel(table, _texts(table, "yes.", "no.")), tmp_path / "dots.parquet")  # another writing
    dots = [str(a) if a != tmp_path / "yes.parquet" else str(tmp_path / "dots.parquet") for a in common]
    assert main([*dots, "--steps", "6", "--resume"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "no label of the first" in line]
    assert len(warned) == 1 and "positive label 'yes'" in warned[0] and "trains on zeros" in warned[0], warned


@pytest.mark.slow
def test_eval_and_resume_read_labels_by_the_run_s_rule_or_say_why_not(tmp_path, dynemb, capsys):
    """Files whose labels do not fit the run's rule: a run of 0/1 labels given text labels (the hint named
    --positive-label, which eval lacks); a run of '>50K' given 0/1 labels (eval read every label as 0, and a
    resume trained on them and kept that model as its best); text labels of which none is '>50K' ('>50K.' as UCI's
    adult.test writes them: a warning, as such a file may hold negatives only)."""
    table = clicks(0, rows=600).drop_columns(["tags"])
    pq.write_table(table, tmp_path / "ints.parquet")
    pq.write_table(_relabel(table, _texts(table, ">50K", "<=50K")), tmp_path / "text.parquet")
    pq.write_table(_relabel(table, _texts(table, ">50K.", "<=50K.")), tmp_path / "dots.parquet")
    common = ["--label", "click", *COLUMNS, "--steps", "3", "--batch-size", "128", "--dim", "4", "--no-progress"]
    dynemb("train", "--data", tmp_path / "ints.parquet", "--out", tmp_path / "ints", *common)
    dynemb("train", "--data", tmp_path / "text.parquet", "--out", tmp_path / "text", *common,
           "--positive-label", ">50K")

    assert main(["eval", "--model", str(tmp_path / "ints"), "--data", str(tmp_path / "text.parquet")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("labels must be 0 or 1, got text ('>50K', '<=50K'); the run was trained on 0/1 labels (no "
                         "--positive-label in its model.json), so its eval files need 0/1 labels or booleans too"), line

    refused = (f"{tmp_path / 'ints.parquet'}: column 'click' has type int64, whose values never read as the positive "
               "label '>50K' (labels are compared as text): give labels as the run was trained on them (text such as "
               "'>50K'), or 0/1 labels to a run trained without --positive-label")
    assert main(["eval", "--model", str(tmp_path / "text"), "--data", str(tmp_path / "ints.parquet")]) == 2
    assert capsys.readouterr().err == f"dynemb eval: error: {refused}\n"
    best = (tmp_path / "text" / "checkpoint-best" / "latest").read_bytes()
    assert main(["train", "--data", str(tmp_path / "ints.parquet"), "--out", str(tmp_path / "text"), *common[:6],
                 "--steps", "6", "--resume", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"dynemb train: error: {refused}"
    assert (tmp_path / "text" / "checkpoint-best" / "latest").read_bytes() == best

    result = dynemb("eval", "--model", tmp_path / "text", "--data", tmp_path / "dots.parquet")
    assert result["auc"] is None
    assert main(["eval", "--model", str(tmp_path / "text"), "--data", str(tmp_path / "dots.parquet")]) == 0
    assert (f"dynemb eval: warning: {tmp_path / 'dots.parquet'}: column 'click': no label equals the run's positive "
            "label '>50K' (its model.json; compared as text), so every row is read as 0") in capsys.readouterr().err
