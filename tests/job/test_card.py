"""The model card writes its training config with TrainConfig.to_dict() and reads cards of version 1 and 2."""

from __future__ import annotations

import json

import pytest

from dynemb.data.preprocess import Preprocessing
from dynemb.job.card import CARD, ModelCard, read_card, write_card
from dynemb.train import TrainConfig


def _card(**config) -> ModelCard:
    return ModelCard(preprocessing=Preprocessing(label="y", categorical=("a", "b")),
                     config=TrainConfig(steps=7, dim=8, optimizer="rowwise_adagrad", **config), data={"rows": 10})


def test_the_card_holds_the_config_as_its_dict_and_reads_it_back(tmp_path):
    card = _card(max_capacity=100, eviction="lfu")
    write_card(tmp_path, card)
    saved = json.loads((tmp_path / CARD).read_text())
    assert saved["version"] == 2 and saved["config"] == card.config.to_dict()
    assert saved["config"]["type"] == "train"
    assert read_card(tmp_path).config == card.config


def test_a_version_1_card_reads(tmp_path):
    write_card(tmp_path, _card())
    saved = json.loads((tmp_path / CARD).read_text())
    saved["version"] = 1
    del saved["config"]["type"]  # version 1 wrote dataclasses.asdict(config)
    (tmp_path / CARD).write_text(json.dumps(saved))
    assert read_card(tmp_path).config == _card().config


def test_a_card_config_with_an_unknown_field_is_named(tmp_path):
    write_card(tmp_path, _card())
    saved = json.loads((tmp_path / CARD).read_text())
    saved["config"]["warmup"] = 3
    (tmp_path / CARD).write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"model\.json: config: unknown field\(s\) \['warmup'\]"):
        read_card(tmp_path)


def test_an_export_root_given_as_a_run_says_what_it_is(tmp_path):
    """``dynemb export --model EXPORT`` (or eval/predict): the export root's model.json is not a card; the error says
    it is an export, not "format must be 'dynemb.run' ..., got None"."""
    root = tmp_path / "export"
    (root / "version-00000001").mkdir(parents=True)
    (root / CARD).write_text(json.dumps({"model": "run-1234"}))
    (root / "latest").write_text(json.dumps({"name": "version-00000001", "version": 1}))
    with pytest.raises(ValueError, match=r"export: a serving export \(`dynemb export --out`\), not a `dynemb train "
                                         r"--out` run directory; pass the run directory$"):
        read_card(root)
    (root / CARD).write_text("[1, 2]")  # JSON, but no object: the format error, not a TypeError
    with pytest.raises(ValueError, match="format must be 'dynemb.run'"):
        read_card(root)
