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
