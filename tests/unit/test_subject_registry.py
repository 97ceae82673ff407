"""The subject registry (``modalign.pipeline.subjects``): identifiers -> the text operator's own pseudonyms."""

from __future__ import annotations

import re

import pytest

from modalign.pipeline.subjects import SubjectEntry, load_registry, registry_path, subject_pseudonyms
from modalign.schemas.errors import ConfigError

from test_deid_text import blocks_table, make_op


def test_registry_pseudonyms_are_those_the_text_operator_wrote(tmp_path):
    """A registry entry's tokens are exactly what pseudonymisation put in the text, for the
    tenant's key; an OCR variant of the name (no diacritic) maps to the same token; another
    person's token is not among them; another tenant's key gives other tokens."""
    keys = tmp_path / "vault"
    texts = ["Please ask Øyvind Halvorsen (oyvind.halvorsen@example.no) about the budget.",
             "Minutes taken by Oyvind Halvorsen; next meeting with Margaret Thompson on Monday."]
    out = make_op(keys).process(blocks_table(texts)).column("text").to_pylist()
    written = [set(re.findall(r"<[A-Z_]+_[0-9a-f]{8}>", t)) for t in out]
    entry = SubjectEntry(person=["Øyvind Halvorsen"], email=["oyvind.halvorsen@example.no"])
    mine = subject_pseudonyms(entry, keys)
    person = {t for t, k in mine.items() if k == "person" and t.startswith("<")}
    email = {t for t, k in mine.items() if k == "email" and t.startswith("<")}
    assert len(person) == 1 and len(email) == 1
    assert person | email <= written[0]  # both identifiers, in the first block
    assert person <= written[1]  # the same person written without the diacritic
    others = written[1] - person
    assert others and not others & set(mine)  # Margaret Thompson is somebody else
    assert all(len(t) == 64 for t in mine if not t.startswith("<"))  # the `hash` action's digests
    other_tenant = subject_pseudonyms(SubjectEntry(tenant="acme", person=["Øyvind Halvorsen"]), keys)
    assert other_tenant == {}  # acme has no key: nothing was ever pseudonymised with it


def test_registry_is_validated_without_repeating_its_personal_data(tmp_path):
    reg = tmp_path / "keys" / "subjects.yaml"
    reg.parent.mkdir()
    reg.write_text("subject-0001:\n  person: [Ada Lovelace]\n  email: [ada@example.org]\n")
    loaded = load_registry(reg)
    assert loaded.entry("subject-0001").identifiers() == [("person", "Ada Lovelace"), ("email", "ada@example.org")]
    assert registry_path(None, tmp_path / "keys") == reg
    cases = {
        "Ada Lovelace:\n  email: [ada@example.org]\n": "key number 1 is not a data-subject id",
        "subject-0001:\n  person: [Ada Lovelace]\n  nickname: [Countess]\n": "subject-0001.nickname",
        "subject-0001: {person: [Ada Lovelace\n": "not a readable YAML/JSON mapping",
    }
    for text, expected in cases.items():
        reg.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_registry(reg)
        assert expected in str(err.value)
        assert "Ada" not in str(err.value) and "Countess" not in str(err.value)
    out = tmp_path / "out"
    (out / "keys").mkdir(parents=True)
    inside = out / "keys" / "subjects.yaml"
    inside.write_text("subject-0001: {}\n")
    with pytest.raises(ConfigError, match="inside the output folder"):
        load_registry(inside, out=out)
    with pytest.raises(ConfigError, match="no subject registry"):
        load_registry(tmp_path / "missing.yaml")
