"""Promotion a person can trust: forced promotions leave a record, every move of an alias
made through kiln is recorded on the registered model, rollback returns to the version
before, and lineage reads the chain back. On a real embedded MLflow store."""

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from components.errors import RegistryError
from flows.cli import app
from registry import CHAMPION, alias_history, get_version, promote, register_engine, resolve_alias, rollback, version_lineage
from serving.loader import pull_version

from .conftest import engine_with_more_rows
from .test_registry import record

PERSON = "ada@lab"


@pytest.fixture()
def versions(registry_target, engine_dir, tmp_path) -> list[str]:
    """Three registered versions of one engine file (distinct batch profiles: distinct
    engines to the registry); the third failed its gates."""
    made = []
    for index, passed in enumerate((True, True, False)):
        variant = engine_with_more_rows(engine_dir, tmp_path / f"variant-{index}", extra_rows=index)
        made.append(register_engine(registry_target, variant, engine_dir.sha256, record(passed=passed, **{"gates.quality.top1_agreement": "0.5"})).version)
    return made


def test_a_persons_promotions_are_recorded_and_rollback_returns_to_the_version_before(registry_target, versions):
    first, second, _ = versions
    promote(registry_target, CHAMPION, version=first, by=PERSON, reason="first release")
    promote(registry_target, CHAMPION, version=second, by=PERSON, reason="faster")
    moves = alias_history(registry_target, CHAMPION)
    assert [(m.version, m.previous, m.by, m.reason) for m in moves] == [(first, None, PERSON, "first release"), (second, first, PERSON, "faster")]
    assert moves[-1].at.endswith("+00:00")

    info, replaced = rollback(registry_target, by=PERSON)
    assert (info.version, replaced) == (first, second)
    assert resolve_alias(registry_target, CHAMPION).version == first
    again, _ = rollback(registry_target, by=PERSON, reason="the regression was elsewhere")
    assert again.version == second  # a rollback is a move of its own: rolling back twice returns
    assert alias_history(registry_target, CHAMPION)[-1].reason == "the regression was elsewhere"
    tags = MlflowClient(registry_target.tracking_uri).get_registered_model(registry_target.model_name).tags
    assert sorted(k for k in tags if k.startswith("champion.moves.")) == [f"champion.moves.{n:04d}" for n in range(1, 5)]


def test_rollback_after_a_move_in_the_mlflow_ui_returns_to_the_version_kiln_last_set(registry_target, versions):
    first, second, _ = versions
    promote(registry_target, CHAMPION, version=first, by=PERSON)
    MlflowClient(registry_target.tracking_uri).set_registered_model_alias(registry_target.model_name, CHAMPION, second)  # as the UI does
    info, replaced = rollback(registry_target, by=PERSON)
    assert (info.version, replaced) == (first, second)


def test_rollback_with_no_earlier_champion_says_so_and_moves_nothing(registry_target, versions):
    with pytest.raises(RegistryError, match="names no version"):
        rollback(registry_target, by=PERSON)
    promote(registry_target, CHAMPION, version=versions[0], by=PERSON)
    with pytest.raises(RegistryError, match="no earlier version of it is recorded"):
        rollback(registry_target, by=PERSON)
    assert resolve_alias(registry_target, CHAMPION).version == versions[0]


def test_a_failed_version_is_promoted_only_when_forced_with_a_reason_which_is_recorded(registry_target, versions, tmp_path):
    failed = versions[2]
    promote(registry_target, CHAMPION, version=versions[0], by=PERSON)
    for force, reason in ((False, "urgent"), (True, ""), (True, "   ")):
        with pytest.raises(RegistryError, match="did not pass its gates|needs a reason"):
            promote(registry_target, CHAMPION, version=failed, by=PERSON, reason=reason, force=force)
    assert resolve_alias(registry_target, CHAMPION).version == versions[0]
    assert "promotion.forced_reason" not in get_version(registry_target, failed).tags

    promote(registry_target, CHAMPION, version=failed, by=PERSON, reason="hotfix: the gate's data is wrong", force=True)
    tags = get_version(registry_target, failed).tags
    assert tags["promotion.forced_reason"] == "hotfix: the gate's data is wrong" and tags["promotion.forced_by"] == PERSON
    assert tags["promotion.forced_at"].startswith("20")
    pulled = pull_version(registry_target, failed, tmp_path / "cache")  # the server takes it, on that record
    assert pulled.info.version == failed and pulled.engine_dir.sha256 == get_version(registry_target, failed).tags["engine_sha256"]


def test_lineage_reads_the_chain_and_the_moves_of_a_version(registry_target, versions):
    promote(registry_target, CHAMPION, version=versions[0], by=PERSON, reason="first")
    promote(registry_target, CHAMPION, version=versions[1], by=PERSON)
    lineage = version_lineage(registry_target, versions[0])
    assert lineage.info.tags["data_md5"] == "abc.dir" and lineage.run_metrics["gates.quality.top1_agreement"] == 1.0
    assert [(m.version, m.previous) for m in lineage.moves] == [(versions[0], None), (versions[1], versions[0])]
    with pytest.raises(RegistryError, match="has no version 99"):
        version_lineage(registry_target, "99")


def test_kiln_lineage_prints_the_chain_and_rollback_and_promote_refuse_with_exit_2(registry_target, versions, tmp_path, monkeypatch):
    """The verbs in-process (the process boundary is test_cli's): their exit codes and lines."""
    promote(registry_target, CHAMPION, version=versions[0], by=PERSON, reason="first")
    params = tmp_path / "params.yaml"
    params.write_text(
        f"registry: {{tracking_uri: {registry_target.tracking_uri!r}, model_name: {registry_target.model_name}, experiment: {registry_target.experiment}}}\n"
    )
    monkeypatch.chdir(tmp_path)

    def kiln(*args: str):
        return CliRunner().invoke(app, [*args, "--params", str(params)])

    shown = kiln("lineage", versions[0])
    assert shown.exit_code == 0, shown.output
    out = " ".join(shown.stdout.split())
    assert f"version {versions[0]} · @champion" in out and "data version abc.dir" in out and "gates passed" in out
    assert "became @champion (by ada@lab: first)" in out
    missing = kiln("lineage", "99")
    assert missing.exit_code == 2 and "has no version 99" in missing.stderr
    nowhere = kiln("rollback")
    assert nowhere.exit_code == 2 and "no earlier version of it is recorded" in " ".join(nowhere.stderr.split())
    unforced = kiln("promote", "--version", versions[2])
    assert unforced.exit_code == 2 and "did not pass its gates" in " ".join(unforced.stderr.split())
    assert resolve_alias(registry_target, CHAMPION).version == versions[0]  # neither moved it
