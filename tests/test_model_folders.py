"""Model folders made on demand (common/models.py): a `tiny:` model is built aside and renamed into
place whole, so processes that resolve it at once (test workers, a launcher and a script) never
read or write a half-built folder; a missing folder is one clear error."""

import pytest

from longhorizon.common.models import ModelError, _move_into_place, require_model_folder, resolve_model_path


def _folder(path, marker):
    path.mkdir()
    (path / "config.json").write_text(marker)
    return path


def test_a_finished_folder_moves_into_place_and_the_first_one_there_stays(tmp_path):
    target = tmp_path / "model"
    _move_into_place(_folder(tmp_path / "first", "first"), target)
    assert (target / "config.json").read_text() == "first" and not (tmp_path / "first").exists()
    second = _folder(tmp_path / "second", "second")
    _move_into_place(second, target)  # another process finished first: its folder stays
    assert (target / "config.json").read_text() == "first"
    # What a build that died left (no config.json) is replaced.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_text("half")
    _move_into_place(_folder(tmp_path / "third", "third"), broken)
    assert (broken / "config.json").read_text() == "third" and not (broken / "model.safetensors").exists()


def test_a_tiny_model_path_builds_once_and_leaves_no_scratch_folder(tmp_path):
    folder = resolve_model_path(f"tiny:{tmp_path / 'tiny'}:s0,a0")
    assert (folder / "config.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["tiny"]
    made = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(f"tiny:{tmp_path / 'tiny'}:s0,a0") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == made  # not built again
    assert require_model_folder(folder) == folder
    with pytest.raises(ModelError, match="no folder"):
        require_model_folder(tmp_path / "absent")


def test_models_are_kept_in_the_users_cache_whatever_folder_a_command_runs_from(tmp_path, monkeypatch):
    from longhorizon.common.models import model_cache

    monkeypatch.delenv("LONGHORIZON_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache() == model_cache("") == tmp_path / "xdg" / "longhorizon" / "models"
    monkeypatch.setenv("LONGHORIZON_CACHE", str(tmp_path / "mine"))
    assert model_cache() == tmp_path / "mine" / "models"
    assert model_cache(tmp_path / "chosen") == tmp_path / "chosen"  # model.cache_dir wins
    # A relative tiny folder lands in the cache, not in the current folder.
    monkeypatch.chdir(tmp_path)
    folder = resolve_model_path("tiny:tiny-test:s0,a0")
    assert folder == tmp_path / "mine" / "models" / "tiny-test" and (folder / "config.json").is_file()
    assert not (tmp_path / "tiny-test").exists()
