"""A promotion in the real MLflow UI reaches the running server.

Debian's chromium, driven by Playwright (its own browser downloads fail here), opens a
version page of an `mlflow server`, sets `champion` through the UI's alias editor, and the
`kiln serve` app following that alias (webhooks only, no polling) answers with the
version. A version whose gates failed, promoted there by hand, is refused by the server's
loader, which keeps serving and says so in its log and metrics. The version page is saved
as a screenshot (KILN_SCREENSHOT_DIR, when set, gets a copy: the README's is one).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from components.engine_dir import load_engine_dir
from components.gates import gate_report, write_report
from flows.lineage import version_description
from registry import CHAMPION, RegistryTarget, RunRecord, get_version, promote, register_alias_webhook, register_engine
from serving.app import VERSION_HEADER, ServerSettings, create_app
from serving.sources import AliasSource

from .conftest import SIGNING, engine_with_more_rows, new_mlflow_store
from .live_server import LiveServer, mlflow_server
from .test_registry import record
from .test_serving import SECRET, metrics_of, wait_for_version

CHROMIUM = Path(os.environ.get("KILN_CHROMIUM", "/usr/bin/chromium"))
MODEL = "kiln-ui"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM}: `apt-get install chromium` (.ci/run does)"),
]


@pytest.fixture(scope="module")
def report(engine, reference, data_version, params):
    return gate_report(engine, reference, data_version.texts("eval"), params.gates, params.serving.threads)


@pytest.fixture()
def registry(tmp_path, engine_dir, tiny_model, params, report) -> tuple[RegistryTarget, list[str]]:
    """Three versions of the fp32 engine (batch profiles 8, 9, 10: three engines to the
    registry) with the pipeline's descriptions; the third failed its gates; the first is
    champion."""
    target = RegistryTarget(new_mlflow_store(tmp_path / "mlflow.db"), MODEL, MODEL, tmp_path / "artifacts", SIGNING)
    reports = tmp_path / "gates"
    write_report(report, reports)
    versions: list[str] = []
    for index, passed in enumerate((True, True, False)):
        variant = engine_with_more_rows(engine_dir, tmp_path / f"engine-{index}", extra_rows=index)
        tags = record(passed=passed).version_tags | {name: f"{value:.6g}" for name, value in report.flat_numbers().items()}
        champion = get_version(target, versions[0]) if versions else None
        description = version_description(params, tiny_model, load_engine_dir(variant), report, None, "0" * 40, champion)
        run = RunRecord({}, {}, tags, description=description, artifacts={"gates": reports})
        versions.append(register_engine(target, variant, engine_dir.sha256, run).version)
        if index == 0:
            promote(target, CHAMPION, version=versions[0])
    return target, versions


@pytest.fixture()
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield chromium
        chromium.close()


def set_alias_in_the_ui(page, url: str, version: str, alias: str) -> None:
    """What a person does: open the version page, the alias editor, type, save."""
    page.goto(f"{url}/#/models/{MODEL}/versions/{version}")
    page.locator('button[title="Add aliases"], button[title="Edit aliases"]').first.click(timeout=60_000)
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("combobox").fill(alias)
    dialog.get_by_role("combobox").press("Enter")
    dialog.get_by_role("button", name="Save aliases").click()
    dialog.wait_for(state="hidden", timeout=30_000)
    page.get_by_role("status", name=alias).first.wait_for(timeout=30_000)


def test_a_champion_set_in_the_mlflow_ui_is_served_and_a_failed_one_is_refused(registry, browser, tmp_path, caplog):
    target, (first, second, failed) = registry
    with mlflow_server(target.tracking_uri, target.artifact_root) as url, LiveServer(app_following(target, tmp_path)) as live:
        register_alias_webhook(RegistryTarget(url, MODEL, MODEL), f"{live.url}/hooks/mlflow", SECRET)
        assert served_version(live) == first
        page = browser.new_page(viewport={"width": 1400, "height": 1100})

        set_alias_in_the_ui(page, url, second, CHAMPION)
        wait_for_version(live, second, timeout=30)
        save_screenshot(page, tmp_path / "version-page.png")
        page.get_by_role("link", name=re.compile(r"^run [0-9a-f]{12}$")).click()  # the description's link to the reports
        page.get_by_text("latency.png").first.wait_for(timeout=30_000)

        set_alias_in_the_ui(page, url, failed, CHAMPION)
        deadline = time.monotonic() + 30
        while metrics_of(live).get('kiln_engine_swaps_total{"result": "refused"}', 0) < 1:
            assert time.monotonic() < deadline, "the server never refused the failed version"
            time.sleep(0.2)
        assert served_version(live) == second
        assert httpx.get(f"{live.url}/v1/models").json()["data"][0]["version"] == second
    assert any(f"keeping version {second}" in r.getMessage() and "did not pass its gates" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "version-page.png").stat().st_size > 10_000


def app_following(target: RegistryTarget, root: Path):
    settings = ServerSettings(poll_interval_s=0, max_tokens=16, max_body_bytes=4096, webhook_secret=SECRET)  # webhooks only
    return create_app(AliasSource(target, CHAMPION, root / "cache"), settings)


def served_version(live: LiveServer) -> str:
    response = httpx.post(f"{live.url}/v1/completions", json={"model": MODEL, "prompt": "The list", "max_tokens": 4}, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers[VERSION_HEADER]


def save_screenshot(page, path: Path) -> None:
    """The version page as a person sees it, without the assistant side panel."""
    close = page.get_by_role("button", name=re.compile("^Close$"))
    if close.count():
        close.first.click()
    page.wait_for_timeout(500)
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("KILN_SCREENSHOT_DIR"):
        shutil.copy(path, Path(os.environ["KILN_SCREENSHOT_DIR"]) / path.name)
