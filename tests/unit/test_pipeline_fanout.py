"""A request's fan-out: its own, else the server's --pipeline-fanout, else its mode's default (3
candidates per outcome every round under `on`; under `auto`, whose cost model picks the fan-out,
up to all the draft's candidates)."""

from __future__ import annotations

import pytest

from orchestrator.k_policy import FixedK, Speculation
from orchestrator.pipelining import DEFAULT_PIPELINE_FANOUT, MAX_PIPELINE_FANOUT, FixedPipeline
from orchestrator.service import OrchestratorConfig, OrchestratorService
from specdec.errors import OutOfRange

UNUSED = "127.0.0.1:9"  # the service is built, never started: no replica is asked anything


def _service(**config: object) -> OrchestratorService:
    return OrchestratorService(OrchestratorConfig(draft=UNUSED, target=UNUSED, **config))


@pytest.mark.parametrize("server_mode,request_mode,expected", [
    ("on", None, DEFAULT_PIPELINE_FANOUT),
    ("auto", None, MAX_PIPELINE_FANOUT),
    ("off", "auto", MAX_PIPELINE_FANOUT),  # the request's mode decides the default
    ("auto", "on", DEFAULT_PIPELINE_FANOUT),
])
def test_a_fanout_left_unset_takes_the_modes_default(server_mode, request_mode, expected):
    service = _service(pipeline=server_mode)
    assert service.pipeline_fanout(Speculation(pipeline=request_mode)) == expected


def test_the_servers_fanout_and_then_the_requests_take_precedence():
    service = _service(pipeline="auto", pipeline_fanout=2)
    assert service.pipeline_fanout(Speculation()) == 2
    assert service.pipeline_fanout(Speculation(pipeline_fanout=5)) == 5
    assert service.pipeline_fanout(Speculation(pipeline_fanout=0)) == 0  # 0 is a value, not unset


def test_on_drafts_ahead_the_default_fanout_every_round():
    policy = _service(pipeline="on").pipeline(Speculation(), FixedK(3))
    assert isinstance(policy, FixedPipeline) and policy.fanout == DEFAULT_PIPELINE_FANOUT
    assert policy.plan(3, 16).fanout == DEFAULT_PIPELINE_FANOUT


def test_out_of_range_fanouts_are_refused():
    with pytest.raises(OutOfRange):
        _service().pipeline_fanout(Speculation(pipeline="on", pipeline_fanout=MAX_PIPELINE_FANOUT + 1))
    with pytest.raises(ValueError):
        _service(pipeline_fanout=-1)
