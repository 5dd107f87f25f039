"""What a `corpus.updated` event may choose (the `scheduled-retrain` trigger's parameters):
a shipped config by name, a config file only inside the deployment's `config_dirs`, and
never the allow-list (`ingest.allowed_sources` stays the deployment config's). Errors about
a file an event named name it, never quote it."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from mlm_pipeline_flows.pretrain_params import PretrainParams
from mlm_pipeline.errors import ConfigError

SECRET = "s3cr3t-token-do-not-leak"
#: The deployment's config (tiny) allow-list, read from the file itself.
TINY_ALLOWED = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
                              .read_text())["ingest"]["allowed_sources"]


def _event(**payload) -> PretrainParams:
    """The parameters the trigger renders: the deployment's own `config` and
    `config_dirs`, the payload's fields ('' when absent), as prefect.yaml writes them."""
    config_dirs = payload.pop("config_dirs", [])
    return PretrainParams.model_validate({
        "config": "tiny", "config_dirs": config_dirs,
        "event_config": payload.get("config", ""),
        "event_config_file": payload.get("config_file", ""),
        "event_sources": [payload.get("corpus", "")],
        "overrides": ["tracking.run_name=corpus-updated"]})


def _planted(path, allowed=("/",)):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"name": "planted", "ingest": {
        "sources": ["debian:fr"], "allowed_sources": list(allowed)},
        "tokenizer": {"vocab_size": 128}}) + f"# {SECRET}\n")
    return path


def test_a_config_file_outside_the_declared_directories_is_refused_unquoted(tmp_path):
    planted = _planted(tmp_path / "corpus" / "evil.yaml")
    for dirs in ([], [str(tmp_path / "configs")]):
        params = _event(config_file=str(planted), corpus="debian:fr", config_dirs=dirs)
        with pytest.raises(ValueError) as info:
            params.load()
        message = str(info.value)
        assert str(planted) in message and "refused" in message
        assert SECRET not in message and "allowed_sources" not in message


def test_a_link_in_a_declared_directory_to_a_file_outside_is_refused(tmp_path):
    planted = _planted(tmp_path / "corpus" / "evil.yaml")
    link = tmp_path / "configs" / "ok.yaml"
    link.parent.mkdir()
    link.symlink_to(planted)
    params = _event(config_file=str(link), config_dirs=[str(link.parent)])
    with pytest.raises(ValueError, match="refused"):
        params.resolved()


def test_a_planted_allow_everything_config_does_not_widen_the_allow_list(tmp_path):
    planted = _planted(tmp_path / "configs" / "wide.yaml")
    dirs = [str(planted.parent)]
    cfg = _event(config_file=str(planted), corpus="debian:fr", config_dirs=dirs).load()
    assert cfg.name == "planted"  # the event's file is the config...
    assert cfg.ingest.allowed_sources == TINY_ALLOWED  # ...not the allow-list
    with pytest.raises(ValueError, match="refused before reading") as info:
        _event(config_file=str(planted), corpus="/etc/passwd", config_dirs=dirs).load()
    assert str(TINY_ALLOWED) in str(info.value)


def test_a_shipped_config_by_name_is_accepted_with_the_deployment_allow_list():
    cfg = _event(config="bert-base", corpus="debian:fr").load()
    assert cfg.name == "bert-base"
    assert cfg.ingest.sources == ["debian:fr"]
    assert cfg.ingest.allowed_sources == TINY_ALLOWED
    assert _event(corpus="debian:fr").load().name == "tiny"  # no choice: the deployment's


def test_a_name_that_is_not_a_shipped_config_is_not_a_parameter(tmp_path):
    with pytest.raises(ValidationError):
        _event(config=str(_planted(tmp_path / "x.yaml")))


@pytest.mark.parametrize("content, kind", [
    (f"ingest: [unclosed\n  {SECRET}: x\n", "not valid YAML (line "),
    (f"{SECRET}: 1\ningest:\n  sources: [{SECRET}]\n  bogus_{SECRET}: 2\n",
     "not a valid config"),
    (b"\xff\xfe" + SECRET.encode(), "not a UTF-8 text file"),
])
def test_a_bad_file_in_a_declared_directory_is_named_never_quoted(tmp_path, content, kind):
    bad = tmp_path / "configs" / "bad.yaml"
    bad.parent.mkdir()
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    params = _event(config_file=str(bad), config_dirs=[str(bad.parent)])
    with pytest.raises(ConfigError) as info:
        params.load()
    message = str(info.value)
    assert str(bad) in message and kind in message
    assert SECRET not in message and "bogus" not in message and "unclosed" not in message


def test_a_config_file_the_deployment_sets_is_quoted_as_before(tmp_path):
    bad = tmp_path / "own.yaml"
    bad.write_text("train:\n  max_stepz: 3\n")
    with pytest.raises(ConfigError, match="train.max_stepz"):
        PretrainParams(config_file=str(bad)).load()


def test_the_trigger_parameters_of_an_event_without_a_config_pass_the_schema():
    """The server checks the rendered parameters against the schema before any validator
    runs: an absent payload field renders as "", which the schema must accept."""
    import re

    import jsonschema

    root = Path(__file__).resolve().parents[2]
    deployments = yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]
    retrain = next(d for d in deployments if d["name"] == "scheduled-retrain")
    rendered = yaml.safe_load(re.sub(r"\{\{[^}]*\}\}", "", yaml.safe_dump(
        retrain["triggers"][0]["parameters"])))["params"]
    assert rendered["event_config"] == "" and rendered["event_config_file"] == ""
    jsonschema.validate(rendered, PretrainParams.model_json_schema())
    params = PretrainParams.model_validate(rendered)
    assert params.resolved()[0] == "tiny" and params.config_dirs == []


def _own_sources_file(path: Path, *, sources, **extra) -> Path:
    """A config file an event may name (in a declared directory) that reads `sources`
    itself, with a planted allow-everything list."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tree = {"name": "own-sources", "ingest": {"sources": sources, "allowed_sources": ["/"]},
            "tokenizer": {"vocab_size": 128}, **extra}
    path.write_text(yaml.safe_dump(tree) + f"# {SECRET}\n")
    return path


@pytest.mark.parametrize("sources, extra, field", [
    ([f"/etc/{SECRET}"], {}, "ingest.sources[0]"),
    (["debian:fr"], {"eval": {"holdout_sources": ["debian:fr", f"/etc/{SECRET}"]}},
     "eval.holdout_sources[1]"),
    (["debian:fr"], {"linear_probe": {"data_path": f"/etc/{SECRET}.csv"}},
     "linear_probe.data_path"),
], ids=["ingest.sources", "eval.holdout_sources", "linear_probe.data_path"])
def test_an_event_named_file_reads_only_what_the_deployment_allows(tmp_path, sources, extra,
                                                                    field):
    """An event that names a config file but no corpus: the file's own inputs must pass
    the deployment's allow-list too, refused by field, never quoted."""
    planted = _own_sources_file(tmp_path / "configs" / "own.yaml", sources=sources, **extra)
    params = _event(config_file=str(planted), config_dirs=[str(planted.parent)])
    assert params.event_sources is None  # the event named no corpus
    with pytest.raises(ValueError, match="refused before reading anything") as info:
        params.load()
    message = str(info.value)
    assert field in message and str(TINY_ALLOWED) in message
    assert SECRET not in message and "/etc" not in message


def test_an_event_named_file_with_allowed_sources_runs_under_the_deployment_list(tmp_path):
    planted = _own_sources_file(tmp_path / "configs" / "own.yaml", sources=["debian:fr"])
    cfg = _event(config_file=str(planted), config_dirs=[str(planted.parent)]).load()
    assert cfg.name == "own-sources" and cfg.ingest.sources == ["debian:fr"]
    assert cfg.ingest.allowed_sources == TINY_ALLOWED


def test_a_shipped_config_an_event_picks_reads_only_what_the_deployment_allows():
    """`small` reads `debian:fr-general`, which `tiny` (the deployment's config) does not
    allow: picked by an event without a corpus, it is refused, and quoted (it is ours)."""
    with pytest.raises(ValueError, match="'debian:fr-general'"):
        _event(config="small").load()
    assert _event(config="small", corpus="debian:fr").load().ingest.sources == ["debian:fr"]
