"""A weights transport from outside the repository: a package registers a `WeightsPublisher`
under the `longhorizon.weights` entry point (or is named by a dotted path), and a training run
moves its versions to the actors through it, chosen by `learner.weights_transport` alone and set
up by the keys it declares for itself in `learner.weights_options`."""

from pathlib import Path

import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.learner.weights import TRANSPORTS

REPO_ROOT = Path(__file__).resolve().parent.parent

# Each version goes through a scratch folder of its own outside the run (say, a mount of object
# storage, named by its own option), as one .safetensors file the actors read. It records what it
# wrote, so the test can tell that its code, not a built-in's, moved the weights.
SCRATCH_TRANSPORT = """
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from longhorizon.common.config import Section
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.weights import WeightsPublisher

written = []


class ScratchOptions(Section):
    folder: str = ""
    '''Where each version's folder is made; empty: the system's temporary folder.'''


class ScratchFolderPublisher(WeightsPublisher):
    sends = "path"
    Options = ScratchOptions

    def build(self, state, version):
        folder = Path(tempfile.mkdtemp(prefix=f"v{version}-", dir=self.options.folder or None))
        save_file({name: tensor.detach().cpu().contiguous() for name, tensor in state.items()},
                  str(folder / "weights.safetensors"))
        written.append(version)
        return WeightsUpdate(version=version, path=str(folder))

    def payload_bytes(self, built):
        return (Path(built.path) / "weights.safetensors").stat().st_size
"""


@pytest.fixture
def transport_plugin(install_plugin):
    names = []

    def install(package: str, entry_point: str | None):
        import importlib

        if entry_point is None:
            install_plugin(package, SCRATCH_TRANSPORT)
            names.append(f"{package}:ScratchFolderPublisher")
        else:
            install_plugin(package, SCRATCH_TRANSPORT,
                           {"longhorizon.weights": {entry_point: f"{package}:ScratchFolderPublisher"}})
            names.append(entry_point)
        return importlib.import_module(package), names[-1]

    yield install
    for name in names:  # the registry keeps what it loaded; the package is gone after the test
        TRANSPORTS.unregister(name)


@pytest.mark.parametrize("found_by", ["entry point", "dotted path"])
async def test_a_run_sends_its_versions_through_a_transport_from_outside(
        tmp_path, tiny_codebook_model, transport_plugin, found_by):
    """Sync mode: each step trains on groups played by the version before it, so three steps
    finish only if the actors loaded versions 1 and 2 from the plug-in's folders, made where its
    own option says."""
    from longhorizon.actor.engines.factory import build_engine
    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.launchers.local import train_in_process

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    module, name = transport_plugin("outside_weights", "scratch-folder" if found_by == "entry point" else None)
    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.total_steps=3", "run.mode='sync'",
        f"model.path={str(tiny_codebook_model)!r}", "actor.num_actors=1", "actor.group_size=4",
        "learner.groups_per_step=2", f"learner.weights_transport={name!r}",
        f"learner.weights_options.folder={str(scratch)!r}",
    ])
    engine = build_engine(config, "train")
    await train_in_process(config, engines=[engine])

    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["version"] == 3
    assert module.written[:4] == [0, 1, 2, 3]  # the starting version, then one per step
    assert engine.policy_version >= 2  # loaded from the plug-in's folders
    assert all(r["weights_bytes"] > 0 for r in records)
    assert not (config.run_dir / "weights").exists()  # nothing went through the built-in path
    assert len(list(scratch.glob("v*"))) >= 4  # the folder its option named


def test_a_transport_from_outside_has_its_options_checked_before_the_run(transport_plugin):
    from longhorizon.launch.checks import validate_config

    _, name = transport_plugin("checked_weights", None)
    base = ["env.name='codebook'", "actor.engine='scripted'", "actor.scripted_policy='random'",
            f"learner.weights_transport={name!r}"]
    validate_config(load_config(None, [*base, "learner.weights_options.folder='/tmp'"]))
    with pytest.raises(ConfigError, match=r"^learner.weights_options.folder: expected str, got 3$"):
        validate_config(load_config(None, [*base, "learner.weights_options.folder=3"]))
    with pytest.raises(ConfigError, match=r"^unknown config key learner.weights_options.bucket_mb in "
                                          r"\[learner.weights_options\]; valid keys: folder$"):
        validate_config(load_config(None, [*base, "learner.weights_bucket_mb=64"]))


def test_a_transport_the_engine_cannot_take_is_refused_before_the_run(install_plugin):
    from longhorizon.launch.checks import validate_config

    install_plugin("collective_like", """
from longhorizon.learner.weights import WeightsPublisher


class Streams(WeightsPublisher):
    sends = "collective"
""")
    base = ["env.name='codebook'", "actor.engine='scripted'", "actor.scripted_policy='random'"]
    with pytest.raises(ConfigError, match="actor.engine 'scripted' cannot take weights sent as 'collective'"):
        validate_config(load_config(None, [*base, "learner.weights_transport='collective_like:Streams'"]))
    with pytest.raises(ConfigError, match="learner.weights_transport: unknown weights transport 'carrier-pigeon'"):
        validate_config(load_config(None, [*base, "learner.weights_transport='carrier-pigeon'"]))
    TRANSPORTS.unregister("collective_like:Streams")
