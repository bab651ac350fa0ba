"""Config loading: TOML sections, key=value overrides, and clear errors for unknown keys."""

import pytest

from longhorizon.common.config import ConfigError, Config, config_from_dict, dump_toml, load_config


def test_defaults_and_sections(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[run]\nname = "x"\ntotal_steps = 3\n[actor.sampling]\nmax_new_tokens = 7\n')
    config = load_config(path)
    assert config.run.name == "x" and config.run.total_steps == 3
    assert config.actor.sampling.max_new_tokens == 7
    assert config.learner == Config().learner


def test_overrides_parse_toml_values(tmp_path):
    config = load_config(
        None, ["run.total_steps=12", "horizon.stages=[2, 4]", "env.options={max_depth = 2}", "run.name=abc",
               "learner.learning_rate=3e-4", "run.resume=true"]
    )
    assert config.run.total_steps == 12
    assert config.horizon.stages == [2, 4]
    assert config.env.options == {"max_depth": 2}
    assert config.run.name == "abc"
    assert config.learner.learning_rate == pytest.approx(3e-4)
    assert config.run.resume is True


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"learner\.learning_rat.*valid keys:.*learning_rate"):
        load_config(None, ["learner.learning_rat=1"])
    with pytest.raises(ConfigError, match="unknown config key bogus"):
        config_from_dict({"bogus": {}})


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match="run.total_steps: expected int"):
        load_config(None, ["run.total_steps=\"ten\""])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["run.total_steps"])


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_dump_round_trips(tmp_path):
    config = load_config(None, ["env.options={max_depth = 2, num_distractors = 3}", "horizon.stages=[1, 2]"])
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(config))
    assert load_config(path) == config


def test_shipped_configs_load():
    from pathlib import Path

    for path in sorted((Path(__file__).parent.parent / "configs").glob("*.toml")):
        load_config(path)


def test_a_bundled_config_is_found_by_its_name_from_any_folder(tmp_path, monkeypatch):
    from pathlib import Path

    shipped = Path(__file__).parent.parent / "configs" / "textcraft.toml"
    monkeypatch.chdir(tmp_path)
    assert load_config("textcraft") == load_config(shipped)
    # A file of that name where one runs it comes first; a name that is neither lists the bundled ones.
    (tmp_path / "textcraft").write_text('[env]\nname = "codebook"\n')
    assert load_config("textcraft").env.name == "codebook"
    with pytest.raises(ConfigError, match=r"config file not found: nope \(bundled configs, .*codebook, .*textcraft"):
        load_config("nope")
    with pytest.raises(ConfigError, match="config file not found: sub/textcraft"):
        load_config("sub/textcraft")  # a path is taken as a path


def test_every_bundled_config_resolves_as_recorded():
    """The defaults and each bundled config resolve to the values tests/data/resolved_configs.json
    records (a change of meaning is a change to that file, made by its script, seen in review)."""
    import json
    import sys
    from pathlib import Path

    data = Path(__file__).parent / "data"
    sys.path.insert(0, str(data))
    try:
        from make_resolved_configs import DEFAULTS, resolved_configs
    finally:
        sys.path.remove(str(data))
    recorded = json.loads((data / "resolved_configs.json").read_text())
    today = resolved_configs()
    assert sorted(today) == sorted(recorded)
    assert today[DEFAULTS] == recorded[DEFAULTS]
    for name in today:
        # Each config as a whole: the recorded defaults with its recorded differences.
        assert {**recorded[DEFAULTS], **recorded[name]} == {**today[DEFAULTS], **today[name]}, name
