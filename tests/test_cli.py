"""The ``dynemb`` command on user files: train, resume and export end to end, and one-line errors for bad input.

(eval, predict, the held-out split and the output of ``train`` are in ``tests/job/``.)

Runs that must show the real process boundary (exit status, what reaches stderr) use ``python -m dynemb`` in a
subprocess. The error matrix calls :func:`dynemb.cli.main` in-process, which is what ``python -m dynemb`` runs
(``raise SystemExit(main())``): the returned status is the exit code, and with ``--debug`` the exception escapes,
which is what prints a traceback. Every run is tiny (3-6 steps of 64 samples, dim 4).
"""

import contextlib
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch

from dynemb.cli import main
from dynemb.data import hash_strings
from dynemb.data.stream import held_out
from dynemb.serving import read_export

TINY = ["--steps", "3", "--batch-size", "64", "--dim", "4", "--eval-batches", "1", "--no-progress"]
EPOCH = ["--epochs", "1", "--batch-size", "64", "--dim", "4", "--eval-batches", "1", "--no-progress"]
ROWS = 256


def clicks(id_kind: str) -> pa.Table:
    """``ROWS`` samples whose label depends on the user, so training has a signal; ids as strings or int64."""
    g = torch.Generator().manual_seed(0)
    user = torch.randint(0, 40, (ROWS,), generator=g)
    item = torch.randint(0, 60, (ROWS,), generator=g)
    label = ((user * 7 + item) % 3 == 0).long()
    if id_kind == "string":
        users, items = [f"user-{u}" for u in user.tolist()], [f"item/{i}" for i in item.tolist()]
    else:  # extreme int64 values are ordinary ids
        users = [(u - 20) * (2**57) - (u == 0) for u in user.tolist()]
        items = [2**63 - 1 - i for i in item.tolist()]
    return pa.table({"click": label.tolist(), "user": users, "item": items,
                     "price": torch.rand(ROWS, generator=g).tolist()})


def run_cli(*args, cwd) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dynemb", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=cwd)


def train_args(path, *extra, stop=TINY):
    return ["train", "--data", path, "--label", "click", "--categorical", "user,item", "--dense", "price", *stop,
            *extra]


def summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def exported_keys(export_root, feature: str) -> set:
    manifest, tables = read_export(export_root)
    return set(tables[feature]["keys"].tolist())


@pytest.fixture(autouse=True)
def _restore_threads():
    """In-process runs set torch's thread count (``--threads``); give the rest of the session its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_parquet_with_string_ids_trains_resumes_and_exports(tmp_path):
    table = clicks("string")
    pq.write_table(table, tmp_path / "clicks.parquet")
    run, out = tmp_path / "run", tmp_path / "export"

    first = summary(run_cli(*train_args("clicks.parquet", "--out", run), cwd=tmp_path))
    assert first["step"] == 3 and first["table_rows"] > 0 and 0.0 <= first["auc"] <= 1.0

    resumed = run_cli(*train_args("clicks.parquet", "--out", run, "--resume"), "--steps", "6", cwd=tmp_path)
    assert f"resumed from {run} at step 3" in resumed.stdout
    assert summary(resumed)["step"] == 6
    assert json.loads((run / "checkpoint" / "latest").read_text())["step"] == 6

    exported = run_cli("export", "--model", run, "--out", out, cwd=tmp_path)
    assert exported.returncode == 0 and "exported to" in exported.stdout, exported.stderr[-3000:]
    # 6 steps x 64 samples cover all 243 training rows: every training user is a row, under its documented hash.
    users = table.column("user").to_pylist()
    trained = [u for u, held in zip(users, held_out(torch.arange(ROWS), 0.05, 0).tolist()) if not held]
    assert set(hash_strings(trained).tolist()) <= exported_keys(out, "user") <= set(hash_strings(users).tolist())


@pytest.mark.slow
def test_csv_with_int64_ids_trains_on_the_training_rows_only(tmp_path):
    table = clicks("int")
    pcsv.write_csv(table, tmp_path / "clicks.csv")
    run = tmp_path / "run"
    result = summary(run_cli(*train_args("clicks.csv", "--out", run, stop=EPOCH), cwd=tmp_path))
    held = held_out(torch.arange(ROWS), 0.05, 0)
    assert result["rows"] == int(held.sum()) and result["samples"] == ROWS - result["rows"]  # one epoch: each once
    (shard,) = (run / "checkpoint" / "step-00000004" / "tables").glob("*-item.rank-*.safetensors")
    keys = set(safetensors.torch.load_file(shard)["keys"].tolist())
    items = table.column("item").to_pylist()
    assert keys == {i for i, h in zip(items, held.tolist()) if not h}  # evaluation inserts no held-out id
    assert 2**63 - 1 in keys  # integer ids are taken as they are


# ---------------------------------------------------------------------------------------------- errors
def _bad_file(tmp_path, fmt):
    path = tmp_path / f"clicks.{fmt}"
    path.write_bytes(b"PAR1 not really parquet" if fmt == "parquet" else b"click,user,item,price\n1,a\n0,b,c,1,9\n")
    return path


def _missing_column(tmp_path, fmt):
    return _write(tmp_path, fmt, clicks("string").drop_columns(["item"]))


def _label_not_0_1(tmp_path, fmt):
    """A directory of two parts; the bad label is in the second, so it surfaces inside the training loop."""
    table = clicks("string")
    labels = table.column("click").to_pylist()
    labels[200] = 2
    table = table.set_column(0, "click", pa.array(labels))
    (tmp_path / "clicks").mkdir()
    _write(tmp_path / "clicks", fmt, table.slice(0, 128), "part-0")
    _write(tmp_path / "clicks", fmt, table.slice(128), "part-1")
    return tmp_path / "clicks"


def _empty(tmp_path, fmt):
    return _write(tmp_path, fmt, clicks("string").slice(0, 0))


def _write(tmp_path, fmt, table, name="clicks"):
    path = tmp_path / f"{name}.{fmt}"
    (pq.write_table if fmt == "parquet" else pcsv.write_csv)(table, path)
    return path


ERRORS = {
    "bad_file": (_bad_file, {"parquet": "cannot read it as parquet", "csv": "cannot read it as csv"}),
    "missing_column": (_missing_column, "missing column 'item' (the file has: click, user, price)"),
    "label_not_0_1": (_label_not_0_1, {fmt: f"part-1.{fmt}: column 'click': labels must be 0 or 1, got "
                                       for fmt in ("parquet", "csv")}),
    "empty_dataset": (_empty, "the data set is empty"),
}


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.parametrize("error", list(ERRORS))
def test_bad_input_is_one_line_and_a_nonzero_exit(tmp_path, capsys, error, fmt):
    make, expected = ERRORS[error]
    expected = expected[fmt] if isinstance(expected, dict) else expected
    path = make(tmp_path, fmt)
    code = main(train_args(str(path), "--steps", "6"))
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dynemb train: error: {path}") and expected in lines[0], lines[0]

    with pytest.raises(ValueError, match="labels must be 0 or 1" if error == "label_not_0_1" else None) as info:
        main(train_args(str(path), "--steps", "6", "--debug"))  # escapes: Python prints its traceback
    assert str(info.value) == lines[0].removeprefix("dynemb train: error: ")


@pytest.mark.slow
def test_process_exit_status_and_traceback_only_with_debug(tmp_path):
    path = _bad_file(tmp_path, "parquet")
    quiet, debug = (subprocess.Popen([sys.executable, "-m", "dynemb", *train_args(str(path)), *flag],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
                    for flag in ([], ["--debug"]))
    quiet_err, debug_err = quiet.communicate(timeout=180)[1], debug.communicate(timeout=180)[1]
    assert quiet.returncode == 2
    (line,) = quiet_err.strip().splitlines()
    assert line.startswith(f"dynemb train: error: {path}: cannot read it as parquet (") and "Traceback" not in line
    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug_err and "cannot read it as parquet" in debug_err


@pytest.mark.parametrize("value,expected", [("0", "torch"), ("1", "auto"), (None, "auto")])
def test_dynemb_numba_0_selects_the_torch_kernels(monkeypatch, value, expected):
    from dynemb import cli
    from dynemb.kernels import get_default_backend, use_backend

    if value is None:
        monkeypatch.delenv("DYNEMB_NUMBA", raising=False)
    else:
        monkeypatch.setenv("DYNEMB_NUMBA", value)
    with use_backend("auto"):  # restores the process default afterwards
        cli._kernels_from_environment()
        assert get_default_backend().value == expected


# ---------------------------------------------------------------------------------------------- hygiene
@pytest.mark.slow
def test_piped_output_stays_short(tmp_path):
    """Not a terminal: no progress bar, a progress line every --log-every seconds, the JSON summary last."""
    pq.write_table(clicks("string"), tmp_path / "clicks.parquet")
    every = 0.05  # short enough that a fast machine still logs during the 400 steps
    args = train_args("clicks.parquet", "--out", "run", "--log-every", str(every),
                      stop=["--steps", "400", "--batch-size", "16", "--dim", "4"])
    proc = run_cli(*args, cwd=tmp_path)
    result = summary(proc)
    assert result["step"] == 400
    assert "\r" not in proc.stderr and "it/s" not in proc.stderr  # no tqdm
    lines = (proc.stdout + proc.stderr).splitlines()
    progress = [line for line in lines if line.startswith("step ")]
    assert 0 < len(progress) <= result["seconds"] / every + 1, result  # one per interval, however many steps
    assert len(lines) <= len(progress) + 3 and max(map(len, lines)) < 400, lines


def test_help_shows_every_option_with_its_meaning_and_default():
    from dynemb.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"train", "eval", "predict", "export", "serve-bench", "demo"} <= set(commands)
    for name, command in commands.items():
        text = " ".join(command.format_help().split())  # unwrapped
        for action in command._actions:
            if not action.option_strings or action.dest in ("help", "debug"):
                continue
            assert action.help, f"dynemb {name} {action.option_strings[0]} has no help"
            if action.default is not None and action.default is not False:
                assert f"(default: {action.default})" in text, f"dynemb {name} {action.option_strings[0]}"
            elif not action.required and action.nargs != 0:  # no value by default: the help says what that means
                assert "default" in action.help, f"dynemb {name} {action.option_strings[0]}"
    assert "(default: 0.05)" in " ".join(commands["train"].format_help().split())


@pytest.mark.parametrize("args, message", [
    (["--eviction", "lfu"], "--eviction needs --max-capacity"),
    (["--epochs", "2", "--steps", "3"], "argument --steps: not allowed with argument --epochs"),
    (["--resume"], "--resume needs --out RUN_DIR"),
    (["--eval-data", "x.parquet", "--eval-fraction", "0.1"], "--eval-fraction splits --data"),
    (["--optimizer", "adamw"], "argument --optimizer: invalid choice: 'adamw'"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    pytest.param(["--device", "cuda"], "device='cuda' asks for CUDA, but torch.cuda.is_available() is False",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")),
    (["--device", "gpu"], "device must be a torch.device or a device string"),
    # out of range: an error naming the option, never a default in its place (--steps 0 trained 1,400 steps,
    # --eval-fraction 0 held out 5%, --seconds -1 trained a step) nor a traceback (--threads 0)
    (["--steps", "0"], "argument --steps: must be an int >= 1, got 0"),
    (["--epochs", "0"], "argument --epochs: must be an int >= 1, got 0"),
    (["--seconds", "-1"], "argument --seconds: must be a finite number > 0, got -1"),
    (["--seconds", "0"], "argument --seconds: must be a finite number > 0, got 0"),
    (["--eval-fraction", "0"], "argument --eval-fraction: must be a number in (0, 1), got 0"),
    (["--threads", "0"], "argument --threads: must be an int >= 1, got 0"),
    (["--batch-size", "0"], "argument --batch-size: must be an int >= 1, got 0"),
    (["--lr", "nan"], "argument --lr: must be a finite number >= 0, got nan"),
    (["--patience", "-1"], "argument --patience: must be an int >= 0, got -1"),
    (["--max-capacty", "10"], "unrecognized arguments: --max-capacty 10 (did you mean: --max-capacty -> "
                              "--max-capacity?)"),
])
def test_inconsistent_options_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    pq.write_table(clicks("string"), tmp_path / "clicks.parquet")
    with pytest.raises(SystemExit) if "argument" in message else contextlib.nullcontext() as raised:
        code = main(train_args(str(tmp_path / "clicks.parquet"), *args, stop=[]))
    code = raised.value.code if raised else code
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and line.startswith("dynemb train: error: ") and message in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["eval", "predict", "demo"])
@pytest.mark.parametrize("option, value, message", [
    ("--threads", "0", "argument --threads: must be an int >= 1, got 0"),  # was torch's RuntimeError, traceback
    ("--batch-size", "-1", "argument --batch-size: must be an int >= 1, got -1"),
    ("--seconds", "0", "argument --seconds: must be a finite number > 0, got 0"),
])
def test_scoring_and_demo_options_out_of_range_are_one_line(tmp_path, capsys, command, option, value, message):
    given = {"eval": ["--model", "run", "--data", "d.parquet"], "predict": ["--model", "run", "--data", "d.parquet",
                                                                           "--out", "p.parquet"], "demo": []}
    takes = {"eval": ("--threads", "--batch-size"), "predict": ("--threads", "--batch-size"),
             "demo": ("--threads", "--seconds")}
    if option not in takes[command]:
        pytest.skip(f"{command} has no {option}")
    with pytest.raises(SystemExit) as raised:
        main([command, *given[command], option, value])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert raised.value.code == 2 and line == f"dynemb {command}: error: {message} (see dynemb {command} --help)"


def test_serve_bench_prints_a_short_table_or_json(tmp_path, capsys):
    import dynemb
    from dynemb.checkpoint import export_for_serving

    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.arange(500))
    export_for_serving(tmp_path / "export", emb)
    common = ["serve-bench", "--export", str(tmp_path / "export"), "--batches", "5", "--batch-size", "64",
              "--persistent", "none"]
    assert main(common) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) <= 10 and any(line.startswith("latency p50 / p99") for line in table)
    assert main([*common, "--json"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert json.loads(line)["requests"] == 5
    assert main([*common, "--cache-fraction", "1", "--alpha", "0"]) == 0  # the whole table cached; uniform traffic
    capsys.readouterr()
    for option, value, message in [("--batches", "0", "argument --batches: must be an int >= 1, got 0"),  # traceback
                                   ("--batch-size", "0", "argument --batch-size: must be an int >= 1, got 0"),
                                   ("--cache-fraction", "1.5", "argument --cache-fraction: must be a number in (0, 1], "
                                                               "got 1.5"),  # named models['bench'].cache_fraction
                                   ("--alpha", "-1", "argument --alpha: must be a finite number >= 0, got -1")]:
        with pytest.raises(SystemExit) as raised:
            main([*common, option, value])
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert raised.value.code == 2 and message in line, line
    run = tmp_path / "run"  # a run directory where an export is wanted: said so, with the command that makes one
    run.mkdir()
    (run / "model.json").write_text(json.dumps({"format": "dynemb.run", "version": 2, "model": "dlrm"}))
    assert main(["serve-bench", "--export", str(run)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{run} is a `dynemb train` run directory, not a serving export; write one with `dynemb export" in line


def test_synthetic_training_for_smoke_runs(tmp_path, capsys):
    assert main(["train", "--synthetic", "--steps", "3", "--batch-size", "64", "--dim", "4", "--eval-batches", "1",
                 "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 3 and result["rows"] == 64  # the generator's separate eval split
    assert (tmp_path / "run" / "model.json").is_file()


@pytest.mark.slow
def test_a_missing_optional_package_names_its_extra(tmp_path):
    """Without the ``data`` extra, ``dynemb train`` on a file says which package is missing and what to install, in
    one line; a missing part of an installed package keeps its own message (a fresh interpreter in which that
    import fails)."""
    data = _write(tmp_path, "parquet", clicks("int"))

    def run(blocked):
        script = (f"import sys; sys.modules[{blocked!r}] = None\n"
                  "from dynemb.cli import main\n"
                  f"sys.exit(main(['train', '--data', {str(data)!r}, '--label', 'click', '--categorical', 'user,item', "
                  f"'--out', {str(tmp_path / blocked)!r}, *{TINY!r}]))\n")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 2, out.stderr
        return out.stderr.strip().splitlines()[-1]

    assert run("pyarrow") == ("dynemb train: error: needs the Python package 'pyarrow', which is not installed: "
                              "pip install 'dynemb[data]'")
    partial = run("pyarrow._parquet")  # pyarrow's own message: "not built with support for the Parquet ..."
    assert partial.startswith("dynemb train: error: ") and "pyarrow._parquet" in partial
    assert "pip install" not in partial


def test_the_extras_named_in_errors_are_the_ones_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from packaging.requirements import Requirement

    from dynemb.cli import _EXTRAS

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    distribution = {"simdjson": "pysimdjson", "grpc": "grpcio"}  # import name -> the distribution that provides it
    for package, extra in _EXTRAS.items():
        names = {Requirement(r).name for r in extras[extra]}
        assert distribution.get(package, package) in names, (package, extra, names)


def test_the_patience_default_shown_by_help_is_the_trainer_s():
    from dynemb import cli, train

    assert cli.DEFAULT_PATIENCE == train.DEFAULT_PATIENCE == train.TrainConfig().patience


def test_every_command_that_loads_a_run_chooses_its_model_with_use():
    from dynemb.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("eval", "predict", "export", "serve"):
        (use,) = [a for a in commands[name]._actions if a.dest == "use"]
        assert use.choices == ("best", "last") and use.default in ("best", None), name


@pytest.mark.slow
@pytest.mark.parametrize("where", ["build_parser", "preload"])
def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130(tmp_path, where):
    """A Ctrl-C in the first seconds (torch, numba and pyarrow importing) printed 30-50 lines of traceback, or left
    numba half-imported ("module 'numba' has no attribute 'core'", exit 1). A real process, with SIGINT at its
    default (Python's handler), gets a real SIGINT in the middle of those imports."""
    hook = {"build_parser": "orig = c.build_parser\n"
                            "c.build_parser = lambda: (os.kill(os.getpid(), signal.SIGINT), orig())[1]\n",
            "preload": "orig = importlib.import_module\n"
                       "importlib.import_module = lambda *a: (os.kill(os.getpid(), signal.SIGINT), orig(*a))[1]\n"}
    script = ("import importlib, os, signal, sys\nimport dynemb.cli as c\n" + hook[where]
              + "sys.argv = ['dynemb', 'train', '--data', 'd.parquet', '--label', 'y', '--categorical', 'c', '--out',"
                " 'run']\nsys.exit(c.main())\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: __import__("signal").signal(2, __import__("signal").SIG_DFL))
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "dynemb train: interrupted before it started; nothing was written\n"
    assert not (tmp_path / "run").exists()
