"""The ops page (GET /admin/ui, gateway/ops.html) in a real headless Chromium (Debian's package), driven by
Playwright: it loads with no console error (its Content-Security-Policy refuses anything but its own
script and style, so an injected script would also show up here), shows a rollout's live state, renders
hostile names from the policy as text, and its buttons change the state (checked through the admin API).

A screenshot is saved to $LORAGATE_TEST_ARTIFACTS (default build/test-artifacts/) as ops-page.png.
Without /usr/bin/chromium or the playwright package this test skips, unless LORAGATE_REQUIRE_TOOLS=1
(CI, where .ci/run installs Chromium) makes that a failure.
"""

from __future__ import annotations

import json
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
from mock_upstream import MockUpstream
from policies import ADMIN, ADMIN_KEY, bearer, tenant_yaml
from polling import poll
from processes import serve_in_thread

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# A tenant id, a rollout name and an adapter id that would run script if the page parsed them as HTML.
EVIL_TENANT = '<script>window.pwned = "tenant"</script>'
EVIL_ROLLOUT = "<img src=x onerror=\"window.pwned = 'rollout'\">"
EVIL_ADAPTER = "<b>canary<b>"
KEY = "acme-secret"


def _require(what: str) -> None:
    message = f"{what} is not installed (.ci/run installs Debian's chromium; playwright is a dev dependency)"
    if os.environ.get("LORAGATE_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        _require("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _require("playwright")
    with sync_playwright() as p:
        # The flags keep Chromium off the network: this machine has none beyond loopback.
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield browser
        browser.close()


def ops_policy() -> str:
    rollout = f"""  - name: {json.dumps(EVIL_ROLLOUT)}
    variants: [{{adapter: a1, weight: 1}}, {{adapter: {json.dumps(EVIL_ADAPTER)}, weight: 1}}]
    steps: [10, 50, 100]
    hold_s: 60
    rollback: {{max_error_rate: 0.2, max_ttft_p99_ms: 60000, min_requests: 10, window_s: 60}}"""
    return policies.policy_yaml(
        tenant_yaml("acme", KEY, '["*"]'),
        tenant_yaml(json.dumps(EVIL_TENANT), "evil-secret", '["*"]'),
        rollouts=rollout,
    )


def test_ops_page_shows_live_state_escapes_names_and_its_buttons_act(browser: Any, tmp_path: Path) -> None:
    artifacts = Path(os.environ.get("LORAGATE_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    with MockUpstream(adapters=("a1", EVIL_ADAPTER)) as engine:
        app = build_app(parse_policy(ops_policy()), [engine.url], MemoryRateLimiter(), metrics=GatewayMetrics())
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(3):
                assert (
                    http.post(
                        "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=bearer(KEY)
                    ).status_code
                    == 200
                )
            page = browser.new_page()
            problems: list[str] = []
            page.on("console", lambda msg: problems.append(msg.text) if msg.type in ("error", "warning") else None)
            page.on("pageerror", lambda exc: problems.append(str(exc)))
            page.on("dialog", lambda dialog: dialog.accept())  # the buttons' confirmation

            page.goto(f"{url}/admin/ui")
            assert "default-src 'none'" in http.get("/admin/ui").headers["content-security-policy"]
            page.fill("#key", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("body[data-loaded=yes]")
            page.wait_for_selector("#tenants td:has-text('acme')")
            # Today's usage per tenant, from the ledger: the three requests above, as the engine counted them.
            page.wait_for_selector("#usage td:has-text('acme')")
            usage_row = page.locator("#usage tr", has_text="acme").inner_text().split()
            assert usage_row[0] == "acme" and usage_row[1] == "3" and usage_row[3] == str(3 * engine.behavior.tokens)
            rollout = page.locator(".rollout").first
            assert rollout.get_attribute("data-rollout") == EVIL_ROLLOUT
            assert "progressing" in rollout.inner_text() and "step 1/3 (10%)" in rollout.inner_text()
            # Hostile names are text on the page, never markup.
            assert EVIL_ROLLOUT in rollout.inner_text() and EVIL_ADAPTER in rollout.inner_text()
            assert EVIL_TENANT in page.locator("#tenants").inner_text()
            assert page.locator("#app script, #app img, #app b").count() == 0
            assert page.evaluate("window.pwned") is None
            assert page.evaluate("sessionStorage.getItem('loragate-admin-key')") == ADMIN_KEY
            assert page.context.cookies() == []  # no cookie: the key travels in a header only
            upstreams = page.locator("#upstreams").inner_text()
            assert engine.url in upstreams and "closed" in upstreams and "loragate" in upstreams
            assert "Prefix routing on (this replica)" in upstreams and "index entries" in upstreams

            # Buttons act through the admin API.
            rollout.locator("button[data-action=pause]").click()
            poll(
                lambda: (True,) if admin_state(http)["rollouts"][0]["control"]["status"] == "paused" else None,
                timeout_s=10,
                what="the rollout paused by the page",
            )
            page.wait_for_selector(".rollout h3:has-text('paused')")
            page.locator("#tenants tr", has_text="acme").locator("button[data-action=suspend]").click()
            poll(
                lambda: (True,) if admin_state(http)["tenants"]["acme"]["suspended"] else None,
                timeout_s=10,
                what="the tenant suspended by the page",
            )
            page.wait_for_selector("#overrides td:has-text('acme')")
            assert (
                http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=bearer(KEY)).status_code
                == 403
            )
            page.wait_for_selector("#actions td:has-text('tenant.suspend')")
            page.screenshot(path=str(artifacts / "ops-page.png"), full_page=True)
            assert problems == []

            # Signing out forgets the key; a wrong key gets the login form back with a message.
            page.click("#logout")
            assert page.evaluate("sessionStorage.getItem('loragate-admin-key')") is None
            page.fill("#key", "not-the-admin-key")
            page.click("button[type=submit]")
            page.wait_for_selector("#login-error:has-text('not an admin key')")
            assert page.locator("#app").is_hidden()
            page.close()


def admin_state(http: httpx.Client) -> dict[str, Any]:
    return http.get("/admin/policy", headers=ADMIN).json()


def test_the_page_is_served_without_data_and_never_cached(tmp_path: Path) -> None:
    """GET /admin/ui holds no data of its own (everything comes from GET /admin/policy with the key)."""
    with MockUpstream(adapters=("a1",)) as engine:
        app = build_app(parse_policy(ops_policy()), [engine.url], MemoryRateLimiter(), metrics=GatewayMetrics())
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            resp = http.get("/admin/ui")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    assert resp.headers["cache-control"] == "no-store" and resp.headers["x-frame-options"] == "DENY"
    assert "acme" not in resp.text and EVIL_TENANT not in resp.text and ADMIN_KEY not in resp.text
    assert "innerHTML" not in resp.text and "cookie" not in resp.text.lower()
