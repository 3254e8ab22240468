"""`edgeinfer serve --speculate draft=MODEL` / `self=QUANT`: the server opens the draft model at
start-up (one sequence per slot) and serves its requests; greedy output stays plain decoding's and
the rejection rule keeps the target's distribution through the HTTP path (chi-square of the first
three tokens over seeded requests against llama.cpp's chain on the target's logits)."""

from __future__ import annotations

import collections
import threading

import pytest
from test_batch_engine import f16_path  # noqa: F401  (a session fixture shared with the engine tests)
from test_server import MODEL_FILE, Server

import edgeinfer

pytestmark = pytest.mark.slow

PROMPT = "Name a colour."


@pytest.fixture(scope="module")
def draft_server(f16_path, default_model_path, tmp_path_factory):  # noqa: F811
    s = Server(f16_path, tmp_path_factory.mktemp("serve-draft"), "--parallel", "4", "--ctx", "4096",
               "--speculate", f"draft={default_model_path}")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def single(f16_path):  # noqa: F811
    with edgeinfer.load(f16_path, n_ctx=1024, flash_attn=False) as engine:
        yield engine


def ask(client, **kw):
    return client.chat.completions.create(model=MODEL_FILE,
                                          messages=[{"role": "user", "content": PROMPT}], **kw)


def test_a_draft_model_server_serves_greedy_requests_as_plain(draft_server):
    client = draft_server.client()
    plain = ask(client, temperature=0.0, max_tokens=24, extra_body={"speculation": "off"})
    fixed = {"method": "draft", "adaptive": False, "draft_max": 3, "p_min": 0.0}
    fast = ask(client, temperature=0.0, max_tokens=24, extra_body={"speculation": fixed})
    default = ask(client, temperature=0.0, max_tokens=24)  # the server's method: its draft model
    spec = fast.model_extra["edgeinfer"]["speculation"]
    assert spec["method"] == "draft" and spec["drafted"] > 0 and spec["accepted"] > 0, spec
    assert default.model_extra["edgeinfer"]["speculation"]["method"] == "draft"
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert default.choices[0].message.content == plain.choices[0].message.content


def test_the_rejection_rule_through_the_server(draft_server, single):
    """100 seeded requests at T = 0.7, four at a time, each drafting its 2nd and 3rd tokens."""
    from sequence_chi_square import sequence_chi_square

    client = draft_server.client()
    # n = 100: the fewest runs that give this prompt's concentrated first tokens the three cells expected
    # >= 5 times a chi-square needs (60 give one). At alpha = 1e-3 the test then rejects the first three
    # tokens drawn at twice the temperature (w = 0.42, 3 df) with power 0.67 only (sequence_chi_square.
    # chi_square_power): it is for gross errors; 200 runs would reach 0.99.
    n, length = 100, 3
    fixed = {"method": "draft", "adaptive": False, "draft_max": 3, "p_min": 0.0}
    observed: collections.Counter = collections.Counter()
    drafted = accepted = 0
    lock = threading.Lock()

    def one(seed: int) -> None:
        nonlocal drafted, accepted
        r = ask(client, temperature=0.7, seed=seed, max_tokens=length + 1, logprobs=True,
                extra_body={"speculation": fixed})
        spec = r.model_extra["edgeinfer"]["speculation"]
        with lock:  # a token is known here by its bytes (what the logprobs carry)
            observed[tuple(bytes(t.bytes) for t in r.choices[0].logprobs.content[:length])] += 1
            drafted += spec["drafted"]
            accepted += spec["accepted"]

    for group in range(0, n, 4):
        threads = [threading.Thread(target=one, args=(seed,)) for seed in range(group, group + 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert drafted >= 2 * n and 0 < accepted < drafted
    prompt = single.chat_tokens([{"role": "user", "content": PROMPT}])
    sampling = edgeinfer.SamplingOptions(temperature=0.7)
    result, table = sequence_chi_square(single, prompt, sampling, observed, n, length,
                                        key=lambda ids: tuple(single.token_bytes(t) for t in ids))
    assert result.pvalue > 1e-3, (result, table)


def test_a_self_draft_server_is_served(f16_path, tmp_path):  # noqa: F811
    """`--speculate self=Q8_0` makes the quantized copy at start-up (the quantizer) and serves."""
    s = Server(f16_path, tmp_path / "home", "--parallel", "2", "--ctx", "2048", "--speculate", "self=Q8_0")
    try:
        r = ask(s.client(), temperature=0.0, max_tokens=8)
        assert r.model_extra["edgeinfer"]["speculation"]["method"] == "self=Q8_0"
        assert any("self-draft" in line or "Q8_0" in line for line in s.log), s.log
    finally:
        assert s.stop() == 0
