"""``export_model`` and ``ExportedModel`` against the mistakes users make: a model trained with a submodule kept in
eval mode, a model returning something other than tensors, an in-process request of the wrong dtype or rank,
re-exporting a changed model into the root a server follows, a torch without what the trace needs and a program
another torch wrote. Each is refused with an error naming the culprit, and leaves the model, the export and the
served version as they were."""

import json
import re

import pytest
import torch

from hand_models import TwoTower, train, two_tower_batch

from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.serving import ExportedModel, export_model
from dynemb.serving import model_export


class Tower(torch.nn.Module):
    """One collection of ``tables`` (one feature each, named as the table) and a head with a BatchNorm."""

    def __init__(self, tables=("user",), dim: int = 4) -> None:
        super().__init__()
        self.ec = EmbeddingCollection([TableConfig(name=t, dim=dim, seed=i) for i, t in enumerate(tables)],
                                      [FeatureConfig(name=t, table=t) for t in tables])
        self.tables = list(tables)
        self.norm = torch.nn.BatchNorm1d(dim * len(tables))
        self.head = torch.nn.Linear(dim * len(tables), 1)

    def forward(self, ids):
        out = self.ec({t: ids for t in self.tables})
        return self.head(self.norm(torch.cat([out[t] for t in self.tables], 1))).squeeze(1)


def eager(model, *args):
    model.eval()
    with torch.no_grad():
        return model(*args)


def test_export_leaves_each_module_in_the_mode_it_was_in(tmp_path):
    """A model being trained with a submodule kept in eval mode (a frozen BatchNorm): the export traces it all in
    eval mode and then gives each module back its own mode, not the model's (``model.train()`` would unfreeze
    the BatchNorm, and the next training step would move its running statistics)."""
    model = Tower()
    model(torch.arange(8))
    model.train()
    model.norm.eval()
    export_model(tmp_path, model, (torch.tensor([1, 2]),))
    assert model.training and model.ec.training and model.head.training
    assert not model.norm.training


def test_an_output_other_than_tensors_is_refused_naming_the_output_not_the_inputs(tmp_path):
    class Scored(Tower):
        def forward(self, ids):
            return {"score": super().forward(ids), "rows": int(ids.shape[0])}

    with pytest.raises(TypeError, match=r"^model outputs must be tensors \(or containers of them\); "
                                        r"output\['rows'\] is int$"):
        export_model(tmp_path, Scored(), (torch.tensor([1, 2]),))
    assert not tmp_path.joinpath("latest").exists()


@pytest.fixture(scope="module")
def two_tower(tmp_path_factory):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    model = TwoTower()
    train(model, lambda: two_tower_batch(16, g), 2)
    root = tmp_path_factory.mktemp("two_tower")
    export_model(root, model, two_tower_batch(4, g))
    return model, root, g


def test_in_process_inputs_are_checked_as_a_request_is(two_tower):
    """``ExportedModel`` checks its inputs as ``dynemb serve`` checks a request's (dtype, rank, fixed sizes,
    unknown names), naming the input: a [B, 1] tensor for a [B] input is no longer served as 1-id bags, float64
    dense values no longer fail inside torch. Narrower integer ids are widened, as over the wire."""
    model, root, g = two_tower
    names = ["user_id", "history", "history_lengths", "item_id"]
    batch = two_tower_batch(5, g)
    served = ExportedModel(root)
    try:
        inputs = dict(zip(names, batch))
        narrow = {**inputs, "user_id": inputs["user_id"].int(), "history_lengths": inputs["history_lengths"].short()}
        got, _ = served(narrow)
        assert torch.equal(got["output"], eager(model, *batch))
        with pytest.raises(ValueError, match=r"^input 'user_id': shape \[5, 1\], but the model's shape is \[-1\] "
                                             r"\(-1: any size\): a 1-D tensor$"):
            served({**inputs, "user_id": inputs["user_id"][:, None]})
        with pytest.raises(ValueError, match=r"^input 'item_id': dtype must be torch.int64 \(or a narrower integer "
                                             r"dtype\), got torch.float32$"):
            served({**inputs, "item_id": inputs["item_id"].float()})
        with pytest.raises(ValueError, match=r"^input 'extra' is not an input of this model \(it reads "):
            served({**inputs, "extra": torch.zeros(5)})
        with pytest.raises(TypeError, match=r"^input 'history' must be a tensor, got list$"):
            served({**inputs, "history": inputs["history"].tolist()})
    finally:
        served.close()


def test_a_float64_input_for_a_float32_one_is_refused_naming_it(tmp_path):
    class Dense(Tower):
        def forward(self, ids, x):
            return super().forward(ids) + x.sum(1)

    model = Dense()
    model(torch.arange(4), torch.zeros(4, 2))
    export_model(tmp_path, model, (torch.tensor([1, 2]), torch.zeros(2, 2)))
    served = ExportedModel(tmp_path)
    try:
        with pytest.raises(ValueError, match=r"^input 'x': dtype must be torch.float32, got torch.float64$"):
            served({"ids": torch.tensor([1]), "x": torch.zeros(1, 2, dtype=torch.float64)})
        with pytest.raises(ValueError, match=r"^input 'x': shape \[1, 3\], but size 1 must be 2 \(the model's shape "
                                             r"is \[-1, 2\]\)$"):
            served({"ids": torch.tensor([1]), "x": torch.zeros(1, 3)})
    finally:
        served.close()


def test_a_version_that_changes_the_tables_is_refused_and_changes_nothing(tmp_path):
    """A changed model re-exported into the root a server follows: its version has tables the parameter server
    was not built with. Applying it used to swap the program in while the tables stayed (every request then
    failed, on a table 'not served', and --watch reported the version served); it is refused, naming the tables,
    and the served version keeps answering as before."""
    model = Tower(("user",))
    model(torch.arange(8))
    export_model(tmp_path, model, (torch.tensor([1, 2]),))
    served = ExportedModel(tmp_path)
    try:
        ids = torch.tensor([1, 5, 1000])
        changed = Tower(("user", "item"))
        changed(torch.arange(8))
        version = export_model(tmp_path, changed, (torch.tensor([1, 2]),))
        with pytest.raises(ValueError, match=r"version-00000002: version 2 adds \['item'\] \(tables \['item', "
                                             r"'user'\], served: \['user'\]\): a version that changes the tables is "
                                             r"served by a new server"):
            served.apply_update(version)
        got, at = served({"ids": ids})
        assert at == 1 and served.version == 1
        assert torch.equal(got["output"], eager(model, ids))
        fresh = ExportedModel(tmp_path)  # a new server serves it
        try:
            got, at = fresh({"ids": ids})
            assert at == 2 and torch.equal(got["output"], eager(changed, ids))
        finally:
            fresh.close()
    finally:
        served.close()


def test_a_torch_without_what_the_trace_needs_is_named_before_anything_is_written(tmp_path, monkeypatch):
    class OldConfig:  # torch.fx.experimental._config before torch 2.7: no backed_size_oblivious
        @staticmethod
        def patch(**changes):
            raise AttributeError(f"torch.fx.experimental._config.{next(iter(changes))} does not exist")

    monkeypatch.setattr(model_export, "fx_config", OldConfig)
    model = Tower()
    model(torch.arange(4))
    with pytest.raises(RuntimeError, match=r"^export_model needs torch 2.7 or newer: it traces with "
                                           r"torch.fx.experimental._config.backed_size_oblivious, which torch .* "
                                           r"lacks$"):
        export_model(tmp_path, model, (torch.tensor([1, 2]),))
    assert not tmp_path.joinpath("latest").exists()


def test_a_program_this_torch_cannot_load_names_both_torch_versions(tmp_path, monkeypatch):
    from torch._export.serde.serialize import SerializeError

    model = Tower()
    model(torch.arange(4))
    export_model(tmp_path, model, (torch.tensor([1, 2]),))
    wrote = json.loads((tmp_path / "version-00000001" / "manifest.json").read_text())["program"]["torch"]

    def load(_):
        raise SerializeError("Serialized schema version 99.0 does not match our current schema version 8.0.")

    monkeypatch.setattr(torch.export, "load", load)
    now, wrote = re.escape(torch.__version__), re.escape(wrote)
    with pytest.raises(ValueError, match=rf"program.pt2: torch {now} cannot load this program, which torch {wrote} "
                                         rf"wrote \(SerializeError: Serialized schema version 99.0 .*\); serve it "
                                         rf"with torch {wrote}, or export the model again"):
        ExportedModel(tmp_path)


def test_a_wrapped_model_names_its_inputs_as_the_plain_model(tmp_path):
    """Wrapping is layout: a ``torch.compile``'d or DataParallel model's forward takes ``*args``, and its inputs
    were named ``input0``, ``input1``, ...; they are named by the wrapped model's forward, as the plain one's."""

    class Two(Tower):
        def forward(self, user_ids, bias):
            return super().forward(user_ids) + bias.sum(1)

    model = Two()
    model(torch.arange(4), torch.zeros(4, 3))
    example = (torch.tensor([1, 2]), torch.zeros(2, 3))
    for i, wrapped in enumerate((model, torch.compile(model), torch.nn.DataParallel(model))):
        export_model(tmp_path / str(i), wrapped, example)
        manifest = json.loads((tmp_path / str(i) / "version-00000001" / "manifest.json").read_text())
        assert [t["name"] for t in manifest["program"]["inputs"]] == ["user_ids", "bias"], type(wrapped).__name__


def test_a_refusal_of_the_example_run_keeps_the_traceback_of_where_it_was_raised(tmp_path):
    """A TypeError from the user's own forward (a bug) is reported after ``example_inputs:`` as the collection's
    refusals are; its cause is the original exception, whose traceback shows the line of ``forward``."""

    class Buggy(Tower):
        def forward(self, ids):
            return torch.cat(super().forward(ids), 1)  # a tensor where a sequence of them is needed

    with pytest.raises(TypeError, match=r"^example_inputs: cat\(\)") as e:
        export_model(tmp_path, Buggy(), (torch.tensor([1, 2]),))
    assert isinstance(e.value.__cause__, TypeError)
    import traceback
    assert any(f.name == "forward" and "torch.cat" in (f.line or "")
               for f in traceback.extract_tb(e.value.__cause__.__traceback__))
