"""The ops page's Adapters section (gateway/ops.html, fed by GET /admin/adapters) in a real headless Chromium
through Playwright: each catalog adapter's versions with their state on each engine (with the failure's
reason, last use, loads and evictions), an engine's hostile error text shown as text. Skips without Chromium
or Playwright, unless LORAGATE_REQUIRE_TOOLS=1.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import build_app
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics

import policies
from gateway_testing import CatalogEngine
from policies import ADMIN, ADMIN_KEY, tenant_yaml
from processes import serve_in_thread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
EVIL_ERROR = "<img src=x onerror=\"window.pwned = 'engine'\">"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = None if Path(CHROMIUM).exists() else "chromium"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright"
    if missing is not None:
        if os.environ.get("LORAGATE_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{missing} is not installed")
        pytest.skip(f"{missing} is not installed")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
        )
        yield browser
        browser.close()


def test_the_adapters_section_shows_each_version_on_each_engine(browser: Any) -> None:
    text = policies.policy_yaml(tenant_yaml("acme", "acme-secret", '["*"]'))
    with CatalogEngine() as engine, CatalogEngine() as other:
        engine.cards = [
            {
                "id": "support@1",
                "state": "device",
                "last_used": 1.7e9,
                "loads": 3,
                "evictions": 1,
                "kind": "DoRA",
                "rank": 16,
                "target_modules": ["q_proj", "lm_head"],
            },
            {"id": "support@2", "state": "failed", "error": EVIL_ERROR},
        ]
        app = build_app(parse_policy(text), [engine.url, other.url], MemoryRateLimiter(), metrics=GatewayMetrics())
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            for sha in ("a" * 64, "b" * 64):
                body = {"id": "support", "source": "s3://models/support", "sha256": sha}
                assert http.post("/admin/adapters", json=body, headers=ADMIN).status_code == 201
            assert http.post("/admin/adapters/support@1/deprecate", headers=ADMIN).status_code == 200
            page = browser.new_page()
            problems: list[str] = []
            page.on("console", lambda msg: problems.append(msg.text) if msg.type in ("error", "warning") else None)
            page.on("pageerror", lambda exc: problems.append(str(exc)))
            page.goto(f"{url}/admin/ui")
            page.fill("#key", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("#adapters .adapter[data-adapter=support] td")
            header = [th.inner_text() for th in page.locator("#adapters thead th").all()]
            rows = [[td.inner_text() for td in r.locator("td").all()] for r in page.locator("#adapters tbody tr").all()]
            failed = page.locator("#adapters td span[title]", has_text="failed")
            assert failed.get_attribute("title") == EVIL_ERROR  # the engine's error, as text
            assert page.evaluate("window.pwned") is None and page.locator("#adapters img").count() == 0
            assert problems == []
            page.close()
    assert header == ["version", "state", "kind", "source", "sha256", "published", engine.url, other.url]
    assert [r[0] for r in rows] == ["1", "2"]
    assert [r[1] for r in rows] == ["deprecated", "active"]
    # What each version is, as the engine that read its files says: unknown before any has.
    assert [r[2] for r in rows] == ["DoRA r16\nq_proj, lm_head", "-"]
    # Each engine's state, then the reason of a failure, when it was last used, its loads and evictions.
    assert [(r[6], r[7]) for r in rows] == [
        ("device\nused 2023-11-14 22:13:20Z · 3 loads · 1 eviction", "not loaded"),
        (f"failed\n{EVIL_ERROR}", "not loaded"),
    ]
    assert rows[0][3] == "s3://models/support" and rows[0][4] == "a" * 12
