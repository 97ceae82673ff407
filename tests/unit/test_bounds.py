"""Config and manifest bounds: out-of-range values fail before any work, naming the dotted field."""

from __future__ import annotations

import time

import pytest

from hostile_corpus import HOSTILE_CONFIGS, HOSTILE_MANIFESTS
from modalign.pipeline.discovery import discover
from modalign.schemas.config import RunConfig
from modalign.schemas.errors import ConfigError
from modalign.schemas.load import load_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("yaml_text, field", HOSTILE_CONFIGS)
def test_out_of_bounds_config_names_the_field(tmp_path, yaml_text, field):
    (tmp_path / "c.yaml").write_text(yaml_text + "\n")
    with pytest.raises(ConfigError) as err:
        load_model(RunConfig, tmp_path / "c.yaml")
    assert field in str(err.value)


def _manifest(tmp_path, body: str):
    (tmp_path / "m.yaml").write_text("session_id: s\nsources:\n" + body)
    return tmp_path / "m.yaml"


@pytest.mark.parametrize("body, needle", HOSTILE_MANIFESTS)
def test_out_of_bounds_manifest_names_the_field(tmp_path, body, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace(">", ">")):
        discover(_manifest(tmp_path, body))


def test_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "c.yaml").write_text("\n".join(lines) + "\nembed:\n  image_encoder: {name: x, weights: w.pt, "
                                     "factory: 'm:f', factory_kwargs: {bomb: *a8}}\n")
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases"):
        load_model(RunConfig, tmp_path / "c.yaml")
    assert time.monotonic() - started < 5  # refused while parsing, never expanded


def test_a_huge_manifest_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "m.yaml"
    with open(path, "w") as f:
        f.write("session_id: s\nsources:\n")
        row = "  - {id: a, uri: a.wav, modality: audio}\n"
        f.write(row * (5 * 2**20 // len(row)))
    with pytest.raises(ConfigError, match="byte limit"):
        discover(path)
