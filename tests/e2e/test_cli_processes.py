"""End to end: the three services as separate processes started through the CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from specdec_cli.client import chat_request
from specdec_cli.processes import specdec_command, start_service
from specdec_cli.stack import stop_services
from specdec.v1 import orchestrator_pb2 as pb

from tests.process_groups import run_specdec
from tests.stack import generate

MAX_NEW_TOKENS = 20


@pytest.fixture(scope="module")
def services(tiny_pair):
    started = []
    try:
        for role, model in (("target", tiny_pair.target_dir), ("draft", tiny_pair.draft_dir)):
            started.append(start_service(role, ["--model", str(model), "--dtype", "float64", "--port", "0",
                                                "--health-port", "0", "--threads", "1"], timeout=300))
        target, draft = started
        started.append(start_service("orchestrator", ["--target", target.address, "--draft", draft.address,
                                                      "--port", "0", "--num-speculative-tokens", "3"], timeout=300))
        yield {s.role: s for s in started}
    finally:
        stop_services(started)  # every one, before any assertion
    for service in started:
        assert service.process.returncode == 0, service.output()


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return output[0, len(prompt):].tolist()


def test_model_services_warm_up_before_they_report_ready(services):
    """Each model service runs its pass shapes once (verify passes of 1 to K_max + 1 = 17 rows)
    before it reports ready, so that no request pays a device's first-use costs."""
    for role in ("target", "draft"):
        output = services[role].output()
        assert "warmed up: 19 passes (up to 17 rows)" in output, output[-2000:]
        assert output.index("warmed up") < output.index(f"READY {role}")


def test_model_services_sharing_the_cpus_without_a_pass_lock_are_warned_about(services):
    """The fixture's target and draft compute on this machine's CPUs and take no --pass-lock: the
    orchestrator warns at start, naming both and the flag, and its Pools answer (`specdec pools`)
    says so. (`specdec up`, whose two share a lock, has no such warning: test_up_... below.)"""
    draft, target = services["draft"].address, services["target"].address
    output = services["orchestrator"].output()
    assert (f"the draft replica at {draft} computes on the hardware of the target replica at {target} and their "
            "forward passes do not take turns") in output, output[-3000:]
    assert output.count("do not take turns") == 1, output[-3000:]  # once, not per request
    pools = subprocess.run(specdec_command("pools", "--orchestrator", services["orchestrator"].address, "--json"),
                           capture_output=True, text=True, timeout=120)
    assert pools.returncode == 0, pools.stderr
    answer = json.loads(pools.stdout)
    assert answer["draft_shares_compute"] and answer["shared_compute_without_turns"], answer


def test_generate_command_prints_json(services, reference_target):
    result = subprocess.run(
        specdec_command("generate", "--orchestrator", services["orchestrator"].address,
                        "--prompt-ids", "5,9,13,2,8", "--max-new-tokens", str(MAX_NEW_TOKENS), "--json"),
        capture_output=True, text=True, timeout=120, check=True,
    )
    output = json.loads(result.stdout)
    assert output["token_ids"] == _reference(reference_target, [5, 9, 13, 2, 8])
    assert output["stats"]["generated_tokens"] == len(output["token_ids"])
    assert output["stats"]["rounds"] >= 1
    assert set(output) == {"token_ids", "text", "finish_reason", "stats"}


def test_eight_concurrent_streams_are_each_correct(services, reference_target):
    # Half the streams pin K = 3, so drafting is certain; half use the server's default, adaptive K,
    # which may rightly choose K = 0 for a draft as costly as this tiny target (its choice depends
    # on timings), so for those only the output and the stats' bookkeeping are checked.
    fixed = pb.SpeculationConfig(mode=pb.SPECULATION_MODE_FIXED, num_speculative_tokens=3)
    prompts = [[3 + i, 10 + i, 20 + (i * 3) % 25, 7] for i in range(8)]
    requests = [pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=MAX_NEW_TOKENS,
                                   speculation=fixed if i % 2 == 0 else None) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda r: generate(services["orchestrator"].address, r), requests))
    for prompt, request, (tokens, _, last) in zip(prompts, requests, results):
        assert tokens == _reference(reference_target, prompt)
        stats = last.stats
        assert stats.drafted_tokens == sum(stats.num_speculative_tokens_per_round)
        assert stats.generated_tokens == len(tokens)
        if request.HasField("speculation"):  # pinned K = 3
            assert stats.drafted_tokens > 0


def test_text_prompt_and_chat_stream_text(services):
    tokens, text, last = generate(services["orchestrator"].address,
                                  pb.GenerateRequest(prompt="hello world", max_new_tokens=MAX_NEW_TOKENS))
    assert tokens and last.stats.generated_tokens == len(tokens)
    chat = chat_request([{"role": "user", "content": "hi there"}], max_new_tokens=5)
    tokens, _, last = generate(services["orchestrator"].address, chat)
    assert last.stats.prompt_tokens == len("u:hi there\na:")


def test_serve_draft_method_suffix_is_a_draft_replica_without_a_model(services, tiny_pair, reference_target):
    """`specdec serve draft --method suffix --model TARGET`: a draft pool's replica that answers
    from a lookup in the target's vocabulary; an orchestrator takes it like any draft replica and
    counts its tokens under "suffix"."""
    started = []
    try:
        started.append(start_service("draft", [
            "--model", str(tiny_pair.target_dir), "--method", "suffix", "--suffix-cache", "shared",
            "--port", "0"], timeout=300))
        started.append(start_service("orchestrator", [
            "--target", services["target"].address, "--draft", started[0].address, "--port", "0",
            "--speculation", "fixed", "--num-speculative-tokens", "4"], timeout=300))
        prompt = [5, 9, 13, 5, 9, 13, 5, 9]  # a repeat for the lookup to follow
        tokens, _, last = generate(started[1].address, pb.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=MAX_NEW_TOKENS))
        assert tokens == _reference(reference_target, prompt)
        assert set(last.stats.drafted_tokens_by_method) <= {"suffix"}
        assert "READY draft" in started[0].output() and "model=" in started[0].output()
    finally:
        stop_services(started)
    for service in started:
        assert service.process.returncode == 0, service.output()


@pytest.mark.slow  # ~15 s: a second set of three processes, started and stopped
def test_up_starts_three_processes_and_stops_them_on_ctrl_c(tiny_pair):
    with run_specdec("up", "--target", str(tiny_pair.target_dir), "--draft", str(tiny_pair.draft_dir),
                     "--dtype", "float64", "--port", "0", "--http-port", "0", "--threads", "1") as up:
        address = up.wait_for_line(r"orchestrator at (\S+)", timeout=300).group(1)
        # The stack's draft method is hybrid: with every token of the vocabulary followed by the
        # next in the prompt, the suffix lookup has a continuation for whatever comes first, and
        # the first round verifies all of it: this is the stack's first request, so nothing is
        # measured yet to weigh it against (after one, a stretch of plain rounds may rightly win).
        _, _, last = generate(address, pb.GenerateRequest(prompt_token_ids=list(range(49)) * 2, max_new_tokens=8))
        assert last.stats.drafted_tokens_by_method["suffix"] >= 1, last.stats
        tokens, text, _ = generate(address, pb.GenerateRequest(prompt="hi", max_new_tokens=8))
        assert len(tokens) >= 1
        url = up.wait_for_line(r"OpenAI-compatible HTTP: (http://\S+/v1)$").group(1)
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            completion = client.completions.create(model="any", prompt="hi", max_tokens=8, temperature=0)
        assert completion.choices[0].text == text  # greedy: the same answer through both doors
        for role, name in (("target", "specdec_forward_passes_total"), ("draft", "specdec_queue_seconds"),
                           ("orchestrator", "specdec:generation_tokens_total")):  # each one's /metrics
            metrics_url = up.wait_for_line(rf"^\s+{role}: (http://\S+/metrics)$").group(1)
            assert name in urllib.request.urlopen(metrics_url, timeout=10).read().decode(), role
        up.process.send_signal(signal.SIGINT)
        assert up.wait(120) == 0, up.output()
        assert "stopping" in up.output()
        assert not up.group_alive(), "a service outlived `specdec up`"
    # The two model services share this machine's cores: they name one pass lock, the orchestrator none.
    locks = re.findall(r"\[(\w+)\].*forward passes take turns with the services that name (\S+)", up.output())
    assert sorted(role for role, _ in locks) == ["draft", "target"], up.output()[-3000:]
    assert locks[0][1] == locks[1][1]
    assert "do not take turns" not in up.output()  # the orchestrator sees them take turns


def test_generate_streams_text_that_ends_its_line(services):
    result = subprocess.run(
        specdec_command("generate", "--orchestrator", services["orchestrator"].address,
                        "--prompt", "hello", "--max-new-tokens", "6"),
        capture_output=True, text=True, timeout=120, check=True,
    )
    assert result.stdout.endswith("\n") and result.stdout.strip()
    assert result.stderr.splitlines()[-1].startswith("[")  # the statistics, on a line of their own
