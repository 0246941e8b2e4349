"""Broken policy files pushed while traffic flows: refused and shown, never a failed request; a good one
then takes over, and clears the error."""

from __future__ import annotations

import asyncio
import threading

import httpx

from gateway.auth import hash_key

from polling import poll
from rawhttp import gather_tally, post_json
from stack import PROMPT, SCALE, Stack, auth


def _wait_for(stack: Stack, check, timeout_s: float = 20.0) -> dict:
    return poll(
        lambda: state if check(state := stack.admin_policy()) else None,
        timeout_s,
        interval_s=0.1,
        what="the policy state",
    )


def test_broken_policies_under_load_are_refused_and_a_good_one_takes_over(stack: Stack) -> None:
    original = stack.policy_path.read_text()
    before = stack.admin_policy()
    pushed: dict[str, dict] = {}

    def push() -> None:  # the operator's edits, each seen by the gateway's file watcher
        stack.policy_path.write_text("version: 1\ntenants: [\n")  # not YAML
        pushed["yaml"] = _wait_for(stack, lambda s: s["reload_errors"] == before["reload_errors"] + 1)
        stack.policy_path.write_text(original.replace("max_queue: 8", "max_queue: -1"))
        pushed["key"] = _wait_for(stack, lambda s: s["reload_errors"] == before["reload_errors"] + 2)
        # A good edit: a new tenant appears.
        stack.policy_path.write_text(
            original.replace(
                "tenants:\n", f'tenants:\n  - id: newco\n    api_keys: ["{hash_key("newco-key")}"]\n    adapters: []\n'
            )
        )
        pushed["good"] = _wait_for(stack, lambda s: s["sha256"] != before["sha256"])

    def call():
        return post_json(stack.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, auth("globex"))

    editor = threading.Thread(target=push)
    try:
        editor.start()

        async def load() -> list:
            tallies = []
            while editor.is_alive():  # rounds of 12 concurrent requests (within what the stack admits)
                tallies.append(await gather_tally([call] * (12 * SCALE), concurrency=12))
            return tallies

        tallies = asyncio.run(load())
        editor.join()
        answers = [a for t in tallies for a in t.answers]
        assert not [f for t in tallies for f in t.failures]
        assert len(answers) >= 24 and {a.status for a in answers} == {200}  # no request failed meanwhile
        assert "line" in pushed["yaml"]["last_error"]["message"]
        assert "admission.max_queue" in pushed["key"]["last_error"]["message"]
        assert pushed["key"]["sha256"] == before["sha256"]  # the last good policy stayed active
        assert pushed["good"]["last_error"] is None
        newco = httpx.get(f"{stack.url}/v1/models", headers={"Authorization": "Bearer newco-key"}, timeout=30)
        assert newco.status_code == 200
    finally:
        stack.reload(original)
    assert stack.admin_policy()["sha256"] == before["sha256"]  # as the other scenarios expect it
