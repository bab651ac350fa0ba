"""Config loading: TOML sections, key=value overrides, and clear errors for unknown keys."""

import pytest

from longhorizon.common.config import ConfigError, Config, SamplingConfig, config_from_dict, dump_toml, load_config


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


def test_config_show_prints_what_a_run_gets_and_reads_back_the_same(tmp_path, capsys):
    from longhorizon.common.config import bundled_config_names
    from longhorizon.launch.cli import main
    from longhorizon.learner.algorithms import with_resolved_options

    for name in bundled_config_names():
        assert main(["config", "show", name, "learner.learning_rate=3e-5"]) == 0
        shown = tmp_path / f"{name}.toml"
        shown.write_text(capsys.readouterr().out)
        # What it shows is the config with the algorithm's options filled in, and reads back as it.
        assert load_config(shown) == with_resolved_options(load_config(name, ["learner.learning_rate=3e-5"])), name
    # The built-in algorithm's keys, spelled either way, are shown with its defaults.
    assert main(["config", "show", "quickstart", "learner.algorithm='ppo'", "learner.gamma=0.9"]) == 0
    shown = capsys.readouterr().out
    options = shown[shown.index("[learner.algorithm_options]"):]
    assert "gamma = 0.9\n" in options and 'critic = "shared"\n' in options and "clip_eps = 0.2\n" in options
    assert main(["config", "show", "quickstart", "learner.learning_rat=1"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "longhorizon: error: unknown config key learner.learning_rat in [learner]; valid keys:")


def test_config_schema_describes_every_key(capsys):
    import json

    from longhorizon.common.config import Section
    from longhorizon.launch.cli import main

    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    tables = schema["$defs"]
    assert set(schema["properties"]) == set(Config.model_fields)
    assert {"LearnerConfig", "SamplingConfig", "WandbConfig"} <= set(tables)
    for table, definition in tables.items():
        for key, described in definition["properties"].items():
            assert described.get("description"), f"{table}.{key} has no description"
    assert set(tables["LearnerConfig"]["properties"]) == set(type(Config().learner).model_fields)
    assert tables["LearnerConfig"]["properties"]["learning_rate"]["default"] == Config().learner.learning_rate
    assert issubclass(type(Config().learner), Section)
    # Each built-in algorithm's own keys, described, with their defaults.
    from longhorizon.learner.algorithms import BUILTINS, algorithm_class

    assert set(schema["algorithm_options"]) == set(BUILTINS)
    for name, options in schema["algorithm_options"].items():
        assert set(options["properties"]) == algorithm_class(name).reads(), name
        assert all(described.get("description") for described in options["properties"].values()), name
    assert schema["algorithm_options"]["dapo"]["properties"]["clip_eps_high"]["default"] == 0.28


def test_a_section_replaced_is_checked_like_a_loaded_one():
    learner = Config().learner
    assert learner.replace(learning_rate=3).learning_rate == 3.0 and learner.learning_rate == 1e-6
    with pytest.raises(ConfigError, match="learning_rate: expected float, got 'x'"):
        learner.replace(learning_rate="x")
    with pytest.raises(ConfigError, match="unknown config key bogus"):
        learner.replace(bogus=1)
    with pytest.raises(ValueError, match="max_new_tokens"):  # pydantic's ValidationError
        SamplingConfig(max_new_tokens=1.5)


def _bounded_keys():
    """(dotted key, its field) for every key of every table that declares bounds."""
    from longhorizon.common.config import Section

    def walk(section: type[Section], prefix: str):
        for name, field in section.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
                yield from walk(field.annotation, f"{prefix}{name}.")
            elif field.metadata:
                yield f"{prefix}{name}", field

    return list(walk(Config, ""))


def test_every_bound_refuses_just_outside_and_takes_just_inside():
    """Each declared bound, from the file as a user writes it: the value on a closed bound and just
    inside an open one loads; just outside, NaN and inf are refused in one line naming the key."""
    keys = _bounded_keys()
    assert len(keys) > 80 and "learner.learning_rate" in dict(keys)
    for key, field in keys:
        integer = field.annotation is int
        inside, outside = [], [float("nan"), float("inf"), float("-inf")] if not integer else []
        for constraint in field.metadata:
            for name in ("ge", "gt", "le", "lt"):
                bound = getattr(constraint, name, None)
                if bound is None:
                    continue
                step = 1 if integer else 1e-9 * max(1.0, abs(bound))  # the next value a float can tell apart
                direction = 1 if name in ("ge", "gt") else -1
                inside.append(bound + direction * step * (name in ("gt", "lt")))
                outside.append(bound - direction * step * (name in ("ge", "le")))
        for value in inside:
            value = int(value) if integer else float(value)
            assert getattr_path(load_config(None, [f"{key}={value!r}"]), key) == value, key
        for value in outside:
            value = int(value) if integer else float(value)
            with pytest.raises(ConfigError) as refused:
                load_config(None, [f"{key}={value!r}"])
            assert str(refused.value).startswith(f"{key} must be ") and "\n" not in str(refused.value), key


def getattr_path(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("override, message", [
    ("learner.learning_rate=-1e-3", "learner.learning_rate must be > 0, got -0.001"),
    ("learner.learning_rate=nan", "learner.learning_rate must be > 0, got nan"),
    ("learner.checkpoint_every=0", "learner.checkpoint_every must be >= 1, got 0"),
    ("learner.max_staleness=-1", "learner.max_staleness must be >= 0, got -1"),
    ("learner.groups_per_step=0", "learner.groups_per_step must be >= 1, got 0"),
    ("actor.sampling.temperature=-1", "actor.sampling.temperature must be >= 0, got -1"),
    ("learner.behaviour_weight_cap=0.5", "learner.algorithm_options.behaviour_weight_cap must be >= 1, got 0.5"),
    ("learner.algorithm='dr_grpo' learner.loss_normaliser_tokens=0",
     "learner.algorithm_options.loss_normaliser_tokens must be > 0, got 0"),
    ("learner.kl_coef=-0.1", "learner.kl_coef must be >= 0, got -0.1"),
    ("learner.algorithm='ppo' learner.algorithm_options.value_clip=-0.2",
     "learner.algorithm_options.value_clip must be >= 0, got -0.2"),
    ("learner.max_abs_reward=0", "learner.max_abs_reward must be in (0, 1e12], got 0"),
    ("actor.invalid_reply_reward=inf", "actor.invalid_reply_reward must be a finite number, got inf"),
])
def test_values_that_used_to_start_a_failing_run_are_one_line_on_the_command_line(override, message, capsys):
    from longhorizon.launch.cli import main

    assert main(["config", "show", "codebook", *override.split()]) == 2
    assert capsys.readouterr().err == f"longhorizon: error: {message}\n"


def test_the_collective_transports_older_keys_are_read_as_its_options(tmp_path):
    """learner.weights_backend, weights_bucket_mb and weights_timeout_s, the spelling from before
    each transport owned its keys, land in learner.weights_options, from a file, an override or
    `replace`; one key given both ways is refused in one line."""
    old = tmp_path / "old.toml"
    old.write_text('[learner]\nweights_transport = "collective"\nweights_backend = "gloo"\nweights_bucket_mb = 64\n')
    config = load_config(old, ["learner.weights_timeout_s=30"])
    assert config.learner.weights_options == {"backend": "gloo", "bucket_mb": 64, "timeout_s": 30}
    assert config == load_config(None, ["learner.weights_transport='collective'",
                                        "learner.weights_options={backend = 'gloo', bucket_mb = 64, timeout_s = 30}"])
    assert config.learner.replace(weights_bucket_mb=32).weights_options == {"backend": "gloo", "bucket_mb": 32,
                                                                            "timeout_s": 30}
    with pytest.raises(ConfigError, match=r"^learner.weights_bucket_mb and learner.weights_options.bucket_mb are "
                                          r"both set: keep one$"):
        load_config(old, ["learner.weights_options.bucket_mb=32"])
    # A run's resolved config writes them in their table, and reads back the same.
    shown = dump_toml(config)
    assert "[learner.weights_options]\nbackend = \"gloo\"\nbucket_mb = 64\ntimeout_s = 30\n" in shown
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(shown)
    assert load_config(resolved) == config


def test_a_run_saved_before_the_weights_table_still_loads_whatever_its_transport(tmp_path):
    """Every saved config.toml held the collective's three keys at their defaults; for another
    transport those are dropped (such a run resumes), while a value someone chose still reaches
    the transport, which refuses it."""
    from longhorizon.launch.checks import validate_config

    saved = tmp_path / "config.toml"
    defaults = 'weights_backend = "auto"\nweights_bucket_mb = 128\nweights_timeout_s = 120.0\n'
    saved.write_text('[env]\nname = "codebook"\n[actor]\nengine = "scripted"\n[learner]\n' + defaults)
    assert load_config(saved).learner.weights_options == {}
    validate_config(load_config(saved))
    saved.write_text('[learner]\nweights_transport = "collective"\n' + defaults)
    assert load_config(saved).learner.weights_options == {"backend": "auto", "bucket_mb": 128, "timeout_s": 120.0}
    saved.write_text('[env]\nname = "codebook"\n[actor]\nengine = "scripted"\n[learner]\nweights_bucket_mb = 64\n')
    with pytest.raises(ConfigError, match="declares no options of its own"):
        validate_config(load_config(saved))


def test_a_built_in_algorithms_key_given_both_ways_is_refused():
    with pytest.raises(ConfigError, match=r"^learner.clip_eps and learner.algorithm_options.clip_eps are both set"):
        load_config(None, ["learner.clip_eps=0.1", "learner.algorithm_options.clip_eps=0.2"])
    assert load_config(None, ["learner.clip_eps=0.1"]).learner.algorithm_options == {"clip_eps": 0.1}
