"""The Prometheus endpoint that the HPAs' session metric comes from."""

from __future__ import annotations

import urllib.request

from specdec.metrics import start_metrics_server
from specdec.sampling import SamplingParams


def _scrape(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        if line.startswith("specdec_"):
            name_and_labels, value = line.rsplit(" ", 1)
            values[name_and_labels.split("{")[0]] = float(value)
    return values


def test_metrics_report_sessions_and_tokens(stack, loop_thread):
    port = start_metrics_server(0, "127.0.0.1", stack.target.info)
    before = _scrape(port)
    assert set(before) >= {"specdec_active_sessions", "specdec_cached_tokens", "specdec_load",
                           "specdec_max_sessions"}
    assert before["specdec_max_sessions"] == stack.target.config.budget.max_sessions
    packing = stack.target.info().linear_packing or "none"
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'packing="{packing}"' in next(line for line in body.splitlines()
                                         if line.startswith("specdec_linear_packing_info{"))

    async def hold_a_session():
        handle, _, _ = await stack.target.prefill("metrics-probe", [3, 4, 5, 6], SamplingParams(), False)
        return handle

    loop_thread.run(hold_a_session())
    during = _scrape(port)
    assert during["specdec_active_sessions"] == before["specdec_active_sessions"] + 1
    assert during["specdec_cached_tokens"] >= before["specdec_cached_tokens"] + 4
    # The prefill's pass: batch size and tokens of the last pass, and the running totals.
    assert during["specdec_forward_passes_total"] >= before["specdec_forward_passes_total"] + 1
    assert during["specdec_pass_rows_total"] >= before["specdec_pass_rows_total"] + 4
    assert during["specdec_pass_sessions_total"] >= before["specdec_pass_sessions_total"] + 1
    assert during["specdec_batch_size"] >= 1 and during["specdec_tokens_per_pass"] >= 1
    loop_thread.run(stack.target.release("metrics-probe"))
    assert _scrape(port)["specdec_active_sessions"] == before["specdec_active_sessions"]
