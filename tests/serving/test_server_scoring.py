"""Scoring through the HTTP API, the shape lm-evaluation-harness's ``local-completions``
relies on: ``/v1/completions`` with ``echo``, ``logprobs`` and ``max_tokens`` 0 or 1, and
vLLM's ``prompt_logprobs`` extra; checked against an oracle, the model's own uncached forward
over the same tokens in this process."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hyjax.tiny import make_tiny_model
from tests.serving.server_helpers import ServerProcess, request

T = 300  # seconds a request may take: a loaded CI host compiles a bucket in tens of seconds
ATOL = 2e-4  # float32 on CPU: the server's chunked steps against one uncached step
# Over the 64-token budget, and ASCII: the tiny model's tokens are bytes, and a character
# split over two tokens has no piece of its own (``tokens`` would not add up to the text).
TEXT = "The quick brown fox jumps over the lazy dog 0123456789. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    srv = ServerProcess(make_tiny_model(d / "tiny", seed=1), d / "server.log")
    srv.model_dir = srv_dir = d / "tiny"
    assert srv_dir.exists()
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def tokenizer(server):
    from hyjax.tokenizer import Tokenizer

    return Tokenizer.from_dir(server.model_dir)


@pytest.fixture(scope="module")
def PROMPT(tokenizer):  # noqa: N802
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 64
    return ids


def oracle(model_dir, ids: list[int]) -> np.ndarray:
    """f64[len(ids), vocab]: log_softmax of the model's logits of every token, one step."""
    from hyjax.cache import init_caches
    from hyjax.loader import load_model
    from hyjax.ops import get_ops
    from hyjax.testing import SeqChunk, make_batch

    model, cfg = load_model(model_dir)
    bs, blocks = 16, range(1, -(-len(ids) // 16) + 1)
    batch, _ = make_batch(
        [SeqChunk(ids, 0, blocks, dst_slot=1, all_logits=True)],
        block_size=bs, num_tokens=len(ids), num_seqs=1, max_blocks=len(blocks),
    )  # fmt: skip
    caches = init_caches(cfg, num_blocks=len(blocks) + 1, block_size=bs, num_slots=2,
                         dtype=jnp.float32)  # fmt: skip
    with jax.default_matmul_precision("highest"):
        _, logits = model(batch, caches, get_ops("reference"))
    return np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1))


def completions(server, **body):
    return request("POST", server.url + "/v1/completions", {"temperature": 0.0, **body}, timeout=T)


def check_offsets(lp: dict, text: str) -> None:
    assert "".join(lp["tokens"]) == text
    pos = 0
    for piece, off in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert off == pos
        pos += len(piece)


def test_echo_max_tokens_0_returns_the_prompt_logprobs_of_the_model(server, tokenizer, PROMPT):
    status, body = completions(server, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    assert status == 200, body
    (choice,) = body["choices"]
    text = tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert "prompt_logprobs" not in choice  # vLLM's extra only where asked
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    check_offsets(lp, text)
    want = oracle(server.model_dir, PROMPT)
    expect = [want[p, PROMPT[p + 1]] for p in range(len(PROMPT) - 1)]
    np.testing.assert_allclose(lp["token_logprobs"][1:], expect, atol=ATOL)
    for p, top in enumerate(lp["top_logprobs"][1:]):
        # Keyed by the token's text: tokens with the same text (bytes of a split character)
        # share one key, so a dict may hold fewer than 3 + 1 entries.
        best = np.sort(want[p])[::-1][:3]
        allowed = np.append(best, want[p, PROMPT[p + 1]])
        assert abs(max(top.values()) - best[0]) < ATOL
        assert all(np.abs(allowed - v).min() < ATOL for v in top.values()), p


def test_echo_with_generation_puts_the_prompt_first(server, tokenizer):
    prompt = "hello there, tiny model"
    status, body = completions(server, prompt=prompt, echo=True, logprobs=1, max_tokens=3,
                               ignore_eos=True)  # fmt: skip
    assert status == 200, body
    (choice,) = body["choices"]
    ids = tokenizer.encode(prompt)
    assert choice["text"].startswith(prompt)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and None not in lp["token_logprobs"][1:]
    check_offsets(lp, choice["text"])
    # The same request without echo generates the same tokens.
    status, plain = completions(server, prompt=prompt, logprobs=1, max_tokens=3, ignore_eos=True)
    assert choice["text"] == prompt + plain["choices"][0]["text"]
    assert lp["token_logprobs"][-3:] == plain["choices"][0]["logprobs"]["token_logprobs"]


def test_prompt_logprobs_extra_on_completions_and_chat(server, PROMPT):
    status, body = completions(server, prompt=PROMPT[:40], prompt_logprobs=2, max_tokens=2)
    assert status == 200, body
    plp = body["choices"][0]["prompt_logprobs"]
    want = oracle(server.model_dir, PROMPT[:40])
    assert len(plp) == 40 and plp[0] is None
    for p, entry in enumerate(plp[1:]):
        tok = entry[str(PROMPT[p + 1])]
        assert abs(tok["logprob"] - want[p, PROMPT[p + 1]]) < ATOL
        assert tok["rank"] >= 1 and isinstance(tok["decoded_token"], str)
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(PROMPT[p + 1]))
        assert ranks in ([1, 2], [1], [2])  # the token itself may be one of the top two
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1}
    status, body = request("POST", server.url + "/v1/chat/completions", chat, timeout=T)
    assert status == 200, body
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 1
    status, body = request(
        "POST", server.url + "/v1/chat/completions", {**chat, "stream": True}, timeout=T
    )
    assert status == 400


@pytest.mark.parametrize(
    "bad",
    [
        {"logprobs": 21},
        {"logprobs": -1},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 21},
        {"echo": True, "logprobs": 2, "prompt_logprobs": -3},
        {"max_tokens": 0},  # without echo
        {"max_tokens": -1, "echo": True},
    ],
    ids=str,
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, bad, PROMPT):
    status, body = completions(server, prompt=PROMPT[:8], **bad)
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    status, body = completions(server, prompt=PROMPT[:8], max_tokens=2, echo=True, n=2)
    assert status == 200, body
    assert all(len(c["text"]) > 0 for c in body["choices"])


def test_streamed_echo_sends_the_prompt_once(server, tokenizer, PROMPT):
    import json

    status, text = request(
        "POST", server.url + "/v1/completions",
        {"prompt": PROMPT[:20], "echo": True, "max_tokens": 0, "stream": True, "logprobs": 1},
        timeout=T,
    )  # fmt: skip
    assert status == 200
    events = [json.loads(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
    got = "".join(c["text"] for e in events for c in e["choices"])
    assert got == tokenizer.decode(PROMPT[:20], skip_special_tokens=False)
