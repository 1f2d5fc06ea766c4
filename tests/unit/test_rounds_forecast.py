"""Pipelining auto's request choice by the controller's cost model: the adaptive controller's
forecast of its rounds against its K = 0 stretches (RoundsForecast), and RequestStreaming taking
it, overruled only by measurements that clearly disagree. Synthetic rounds (the simulator of
tests/unit/test_k_controller.py) and synthetic paces: no servers, no clocks."""

from __future__ import annotations

from orchestrator.k_controller import AdaptiveKController, KControllerConfig
from orchestrator.k_policy import RoundsForecast
from orchestrator.pipeline_policy import PipelinePriorEstimates, PipelinePriors
from orchestrator.pipelining import RequestStreaming
from tests.unit.test_k_controller import K_MAX, SimulatedServices, play
from tests.unit.test_k_plain_stretches import auto_controller, draft_hop_world, measured

SURE = PipelinePriorEstimates(c_bonus=(0.97, 0.98, 0.99), c_corr=(0.97, 0.98, 0.99))


def test_the_adaptive_controller_forecasts_its_rounds() -> None:
    controller = AdaptiveKController(KControllerConfig(max_num_speculative_tokens=K_MAX))
    assert isinstance(controller, RoundsForecast)
    assert controller.predicted_rounds_gain(K_MAX) is None  # nothing measured yet


def test_the_forecast_says_whether_drafting_ahead_beats_the_stretches() -> None:
    """A 20 ms draft hop at alpha 0.5: with the default pair's candidate ranks a hit is too rare
    to pay for the misses' hops, and rounds are forecast no faster than the stretches; where the
    draft's top candidates nearly always hold the target's token, clearly faster."""
    rare = auto_controller(measured(PipelinePriors()))
    play(rare, SimulatedServices(1), draft_hop_world(), 200)
    gain = rare.predicted_rounds_gain(K_MAX)
    assert gain is not None and gain < 1.0

    sure = auto_controller(measured(PipelinePriors(initial=SURE)))
    play(sure, SimulatedServices(1), draft_hop_world(), 200)
    gain = sure.predicted_rounds_gain(K_MAX)
    assert gain is not None and gain > 1.05  # above RequestStreaming's margin
    assert sure.predicted_rounds_gain(0) is None  # no room to draft: nothing to forecast


def test_no_forecast_before_the_candidate_ranks_are_measured() -> None:
    """Until the pool has measured drafting ahead, K = 0 is priced as Verify rounds, not as the
    stretches a streamed request is weighed against."""
    priors = PipelinePriors(initial=SURE)
    controller = auto_controller(priors)
    play(controller, SimulatedServices(1), draft_hop_world(), 200)
    assert controller.predicted_rounds_gain(K_MAX) is None
    measured(priors)
    assert controller.predicted_rounds_gain(K_MAX) is not None


def _requests(streaming: RequestStreaming, gain: float | None, paces: dict[bool, float], count: int) -> list[bool]:
    """Whether each of `count` greedy requests streamed, each measured at paces[streamed]."""
    chosen = []
    for _ in range(count):
        streams = streaming.streams_next(True, gain)
        streaming.observe(True, streams, paces[streams])
        chosen.append(streams)
    return chosen


def test_the_forecast_chooses_whatever_the_prompts_made_the_paces() -> None:
    """Rounds forecast faster: requests run rounds even where the streamed requests happened to
    measure a little faster (their prompts', not their way's doing), streaming tried ever more
    rarely; forecast no faster: they stream."""
    rounds = _requests(RequestStreaming(), 1.3, {True: 0.030, False: 0.033}, 200)
    assert sum(rounds) <= 6 and not rounds[0]
    streamed = _requests(RequestStreaming(), 1.02, {True: 0.036, False: 0.030}, 200)
    assert len(streamed) - sum(streamed) <= 6 and streamed[0]


def test_measurements_that_clearly_disagree_overrule_the_forecast() -> None:
    """The rounds forecast faster but measured 50 % slower than streaming: requests stream."""
    streaming = RequestStreaming(veto=0.3)
    chosen = _requests(streaming, 1.3, {True: 0.030, False: 0.045}, 200)
    assert sum(chosen[20:]) >= 170
    assert streaming.favoured(True, 1.3) is True and streaming.is_test(True, False, 1.3)


def test_a_request_against_the_forecast_is_a_test() -> None:
    streaming = RequestStreaming()
    assert streaming.favoured(True, None) is None  # neither forecast nor measured
    assert streaming.favoured(True, 1.3) is False and streaming.favoured(True, 1.0) is True
    assert streaming.is_test(True, True, 1.3) and not streaming.is_test(True, False, 1.3)
    assert streaming.is_test(True, False, 1.0) and not streaming.is_test(True, True, 1.0)
