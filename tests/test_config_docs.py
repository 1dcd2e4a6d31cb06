"""The config reference and the embedded default are generated from the models' descriptions and
fail here when they drift (issue #29, 5)."""

from __future__ import annotations

from pathlib import Path

from grpod import config_docs
from grpod.config import GrpodConfig, load_config

ROOT = Path(__file__).resolve().parents[1]


def _fields(model, seen=None):
    """(model, name, field) of every field of the tree, every source kind and bridge mode included."""
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        yield model, name, field
        item = config_docs._item_model(field.annotation)
        for sub in config_docs._models_in(field.annotation) + ([item] if item else []):
            yield from _fields(sub, seen)


def test_every_field_of_every_kind_has_a_description():
    missing = [f"{model.__name__}.{name}" for model, name, field in _fields(GrpodConfig) if not field.description]
    assert not missing, f"fields without Field(description=...): {missing}"


def test_the_committed_toml_and_reference_are_what_the_generator_writes():
    for relative, text in config_docs.rendered().items():
        committed = (ROOT / relative).read_text()
        assert committed == text, f"{relative} is out of date: run `python -m grpod.config_docs`"


def test_check_mode_names_a_stale_file_and_writes_nothing(tmp_path, capsys):
    for relative, text in config_docs.rendered().items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 0
    stale = tmp_path / config_docs.REFERENCE_PATH
    stale.write_text("edited by hand\n")
    assert config_docs.main(["--check", "--root", str(tmp_path)]) == 1
    assert str(config_docs.REFERENCE_PATH) in capsys.readouterr().err
    assert stale.read_text() == "edited by hand\n"
    assert config_docs.main(["--root", str(tmp_path)]) == 0
    assert stale.read_text() == config_docs.render_reference()


def test_the_embedded_default_differs_from_the_defaults_only_by_its_choices():
    """What `make run` trains with: the model defaults but for EMBEDDED_CHOICES, each set in the file."""
    loaded = load_config(ROOT / config_docs.TOML_PATH).model_dump(mode="json")
    expected = GrpodConfig().model_dump(mode="json")
    for key, choice in config_docs.EMBEDDED_CHOICES.items():
        *sections, name = key.split(".")
        node = expected
        for section in sections:
            node = node[section]
        assert node[name] != choice.value, f"{key}: the choice equals the default; drop it"
        node[name] = choice.value
    assert loaded == expected
