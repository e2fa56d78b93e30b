"""TokenizerCore with the real SmolLM2 tokenizer: encoding and its errors, incremental text with stop
strings and offsets, bounded per-request state."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.protocol.messages import (
    DetokenizeBatch,
    DetokenizeItem,
    EncodeRequest,
    EncodeResult,
    ErrorReply,
    LogprobWire,
    TextDeltaItem,
)
from deepinfer.services.tokenizer_core import TokenizerCore
from deepinfer.text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.load(smollm2_path)


@pytest.fixture
def core(tok: Tokenizer) -> TokenizerCore:
    return TokenizerCore(tok, "tok0", max_model_len=64)


def start(core: TokenizerCore, rid: str = "r1", stop: list[str] | None = None) -> EncodeResult:
    res = core.on_encode(EncodeRequest(rid, prompt="Once upon a time", stop=stop or []))
    assert isinstance(res, EncodeResult)
    return res


def feed(core: TokenizerCore, rid: str, ids: list[int], offset: int, finished: bool = False, **kw) -> list:
    item = DetokenizeItem(rid, offset, ids, finished=finished, **kw)
    deltas = core.on_detokenize(DetokenizeBatch("dec0", 0, [item]))
    assert deltas.tokenizer == "tok0"
    return deltas.items


def stream(core: TokenizerCore, rid: str, ids: list[int], sizes: int = 1, finish: bool = True) -> list[TextDeltaItem]:
    out: list[TextDeltaItem] = []
    for i in range(0, len(ids), sizes):
        last = finish and i + sizes >= len(ids)
        out += feed(core, rid, ids[i : i + sizes], i, finished=last, finish_reason="length" if last else None)
    return out


# ----- encoding -----


def test_prompt_is_encoded_with_the_models_special_tokens(core: TokenizerCore, tok: Tokenizer) -> None:
    res = start(core)
    assert res.request_id == "r1"
    assert res.token_ids == tok.encode("Once upon a time")
    assert res.block_hashes == []
    assert core.num_inflight == 1


def test_messages_go_through_the_chat_template(core: TokenizerCore, tok: Tokenizer) -> None:
    res = core.on_encode(EncodeRequest("r1", messages=MESSAGES))
    assert isinstance(res, EncodeResult)
    assert res.token_ids == tok.encode_chat(MESSAGES)
    assert tok.decode(res.token_ids).endswith("<|im_start|>assistant\n")


def test_token_ids_are_taken_as_they_are(core: TokenizerCore) -> None:
    res = core.on_encode(EncodeRequest("r1", prompt_token_ids=[1, 2, 3, 49151]))
    assert isinstance(res, EncodeResult) and res.token_ids == [1, 2, 3, 49151]


@pytest.mark.parametrize(
    ("req", "says"),
    [
        (EncodeRequest("r1"), "exactly one of"),
        (EncodeRequest("r1", prompt="a", prompt_token_ids=[1]), "exactly one of"),
        (EncodeRequest("r1", prompt=""), "empty"),
        (EncodeRequest("r1", messages=[]), "empty"),
        (EncodeRequest("r1", messages=[{"role": "user"}]), "'role' and 'content'"),
        (EncodeRequest("r1", prompt_token_ids=[]), "no tokens"),
        (EncodeRequest("r1", prompt_token_ids=[5, 49152]), "49152 is outside the vocabulary (size 49152)"),
        (EncodeRequest("r1", prompt_token_ids=[-1]), "outside the vocabulary"),
        (EncodeRequest("r1", prompt_token_ids=list(range(64))), "64 tokens; the model's context is 64"),
        (EncodeRequest("r1", prompt="word " * 100), "room for at least one generated token"),
    ],
)
def test_bad_prompts_are_invalid_requests(core: TokenizerCore, req: EncodeRequest, says: str) -> None:
    res = core.on_encode(req)
    assert isinstance(res, ErrorReply)
    assert (res.request_id, res.code) == ("r1", "invalid_request")
    assert says in res.message
    assert core.num_inflight == 0 and core.counters.refused == 1


def test_the_longest_prompt_leaves_one_token_of_context(core: TokenizerCore) -> None:
    assert isinstance(core.on_encode(EncodeRequest("r1", prompt_token_ids=list(range(63)))), EncodeResult)


def test_max_tokens_must_fit_the_context_with_the_prompt(core: TokenizerCore) -> None:
    fits = core.on_encode(EncodeRequest("r1", prompt_token_ids=list(range(40)), max_tokens=24))
    assert isinstance(fits, EncodeResult)
    over = core.on_encode(EncodeRequest("r2", prompt_token_ids=list(range(40)), max_tokens=25))
    assert isinstance(over, ErrorReply) and over.code == "invalid_request"
    assert "max_tokens 25" in over.message and "at most 24" in over.message
    assert core.num_inflight == 1  # the refused request left no state


def test_a_model_without_chat_template_refuses_messages(tok: Tokenizer) -> None:
    plain = Tokenizer(tok.backend, chat_template=None)
    res = TokenizerCore(plain, "tok0", 64).on_encode(EncodeRequest("r1", messages=MESSAGES))
    assert isinstance(res, ErrorReply) and "no chat template" in res.message


def test_in_flight_requests_are_bounded(tok: Tokenizer) -> None:
    core = TokenizerCore(tok, "tok0", 64, max_inflight=2)
    start(core, "a"), start(core, "b")
    res = core.on_encode(EncodeRequest("c", prompt="hi"))
    assert isinstance(res, ErrorReply) and res.code == "overloaded"
    core.on_abort("a")
    start(core, "c")
    assert core.num_inflight == 2


def test_encoding_again_starts_the_request_over(core: TokenizerCore, tok: Tokenizer) -> None:
    start(core)
    feed(core, "r1", tok.encode(" there", add_special_tokens=False), 0)
    start(core)
    assert core.num_inflight == 1
    assert feed(core, "r1", tok.encode(" again", add_special_tokens=False), 0)[0].text == " again"


# ----- detokenizing -----


@pytest.mark.parametrize("sizes", [1, 2, 3])
def test_emoji_split_across_batches_never_yields_half_a_character(
    core: TokenizerCore, tok: Tokenizer, sizes: int
) -> None:
    text = " Hello 😀👍🏽 wörld 中文!"
    ids = tok.encode(text, add_special_tokens=False)
    start(core)
    items = stream(core, "r1", ids, sizes)
    assert "".join(i.text for i in items) == text
    assert not any("\ufffd" in i.text for i in items)
    assert [t for i in items for t in i.token_ids] == ids
    assert [i.offset for i in items] == list(range(0, len(ids), sizes))
    if sizes == 1:  # the emoji's bytes span tokens: some deltas carry tokens but no text yet
        assert any(i.token_ids and not i.text for i in items)
    assert items[-1].finished and items[-1].finish_reason == "length"
    assert not any(i.finished for i in items[:-1])
    assert core.num_inflight == 0


def test_special_tokens_are_not_text(core: TokenizerCore, tok: Tokenizer) -> None:
    start(core)
    eos = tok.eos_token_ids[0]
    items = feed(core, "r1", [*tok.encode(" end", add_special_tokens=False), eos], 0, True, finish_reason="stop")
    assert items[0].text == " end" and items[0].finish_reason == "stop"


def test_stop_string_across_batches_ends_the_stream(core: TokenizerCore, tok: Tokenizer) -> None:
    ids = tok.encode(" The answer is 42. END of story, more text", add_special_tokens=False)
    start(core, stop=["END of", "never"])
    items = stream(core, "r1", ids, finish=False)
    last = items[-1]
    assert "".join(i.text for i in items) == " The answer is 42. "
    assert (last.finished, last.finish_reason, last.stop_string) == (True, "stop", "END of")
    assert sum(i.finished for i in items) == 1
    assert core.num_inflight == 0
    assert core.counters.unknown > 0  # the tokens after the stop string were dropped


def test_stop_string_completed_by_the_final_batch(core: TokenizerCore, tok: Tokenizer) -> None:
    # The held-back prefix " ST" is completed in the finished item: a stop, not a "length" finish.
    ids = tok.encode(" a b STOP", add_special_tokens=False)
    start(core, stop=["STOP"])
    items = stream(core, "r1", ids)
    assert "".join(i.text for i in items) == " a b "
    assert items[-1].stop_string == "STOP" and items[-1].finish_reason == "stop"


def test_speculation_counts_pass_through_with_multi_token_steps(core: TokenizerCore, tok: Tokenizer) -> None:
    # A speculating worker commits several tokens a step and reports the request's totals so far.
    ids = tok.encode(" one two three four five six", add_special_tokens=False)
    start(core, stop=["five"])
    a = feed(core, "r1", ids[:3], 0, spec_proposed_tokens=4, spec_accepted_tokens=2)
    b = feed(core, "r1", ids[3:], 3, spec_proposed_tokens=8, spec_accepted_tokens=5)  # completes the stop string
    assert [(i.spec_proposed_tokens, i.spec_accepted_tokens) for i in a + b] == [(4, 2), (8, 5)]
    assert b[0].stop_string == "five" and b[0].finished


def test_duplicates_and_overlaps_are_skipped(core: TokenizerCore, tok: Tokenizer) -> None:
    ids = tok.encode(" one two three four", add_special_tokens=False)
    start(core)
    first = feed(core, "r1", ids[:2], 0)
    assert feed(core, "r1", ids[:2], 0) == []  # an exact resend
    lp = [LogprobWire(t, -0.5) for t in ids[1:4]]
    overlap = feed(core, "r1", ids[1:4], 1, logprobs=lp)  # one old token, two new
    assert overlap[0].offset == 2 and overlap[0].token_ids == ids[2:4]
    assert overlap[0].logprobs == lp[1:]
    rest = feed(core, "r1", ids[4:], 4, True, finish_reason="length")
    assert "".join(i.text for i in first + overlap + rest) == " one two three four"
    assert core.counters.duplicates == 2


def test_a_gap_ends_the_request_with_an_error_item(core: TokenizerCore, tok: Tokenizer) -> None:
    ids = tok.encode(" one two three", add_special_tokens=False)
    start(core)
    feed(core, "r1", ids[:1], 0)
    [item] = feed(core, "r1", ids[2:], 2)
    assert (item.finished, item.finish_reason, item.offset, item.token_ids) == (True, "error", 1, [])
    assert core.num_inflight == 0 and core.counters.gaps == 1
    assert feed(core, "r1", ids[1:2], 1) == []


def test_a_finish_without_new_tokens_flushes(core: TokenizerCore, tok: Tokenizer) -> None:
    start(core)
    ids = tok.encode(" ok", add_special_tokens=False)
    feed(core, "r1", ids, 0)
    [item] = feed(core, "r1", [], len(ids), True, finish_reason="length")
    assert item.finished and item.text == "" and item.token_ids == [] and item.offset == len(ids)
    assert core.num_inflight == 0


def test_abort_drops_the_state(core: TokenizerCore, tok: Tokenizer) -> None:
    start(core)
    core.on_abort("r1")
    core.on_abort("r1")  # aborting twice, or an unknown request, is a no-op
    assert core.num_inflight == 0
    assert feed(core, "r1", tok.encode(" x", add_special_tokens=False), 0) == []
    assert core.counters.unknown == 1


def test_one_batch_serves_several_requests(core: TokenizerCore, tok: Tokenizer) -> None:
    start(core, "a"), start(core, "b")
    ids = tok.encode(" hi", add_special_tokens=False)
    batch = DetokenizeBatch(
        "dec0", 7, [DetokenizeItem("a", 0, ids), DetokenizeItem("zzz", 0, ids), DetokenizeItem("b", 0, ids, True)]
    )
    items = core.on_detokenize(batch).items
    assert [(i.request_id, i.text, i.finished) for i in items] == [("a", " hi", False), ("b", " hi", True)]
    assert core.num_inflight == 1


# ----- resume: a request moved off a lost worker -----


@pytest.mark.parametrize("cut", [1, 4, 7, 9])
def test_a_resumed_stream_continues_the_text_exactly(core: TokenizerCore, tok: Tokenizer, cut: int) -> None:
    """Text streamed before the cut (by the first stream) plus text after it (by the resumed one, fed
    only the later tokens) is the whole text: no character repeated, lost or split, stop strings found
    across the cut."""
    text = " Hi 😀👍🏽 wörld. The END of it"
    ids = tok.encode(text, add_special_tokens=False)
    start(core, "first", stop=["END"])
    before = stream(core, "first", ids[:cut], finish=False)
    prompt = start(core, "probe").token_ids
    res = core.on_encode(EncodeRequest("second", prompt_token_ids=prompt, stop=["END"], resume_output_ids=ids[:cut]))
    assert isinstance(res, EncodeResult) and res.token_ids == prompt
    after = [d for i in range(cut, len(ids)) for d in feed(core, "second", [ids[i]], i)]
    assert after[0].offset == cut
    assert "".join(i.text for i in before + after) == " Hi 😀👍🏽 wörld. The "
    assert after[-1].finished and after[-1].stop_string == "END"


def test_resume_hashes_cover_prompt_and_output(tok: Tokenizer, tmp_path: Path) -> None:
    from deepinfer.cache.hashing import CacheNamespace, HashKeys, hash_blocks

    ns = CacheNamespace("m", "t", "float32", "l", block_size=4)
    core = TokenizerCore(tok, "tok0", max_model_len=64, namespace=ns)
    prompt, output = list(range(10, 20)), list(range(30, 37))
    res = core.on_encode(EncodeRequest("r", prompt_token_ids=prompt, cache_salt="s", resume_output_ids=output))
    assert isinstance(res, EncodeResult) and res.token_ids == prompt
    assert res.block_hashes == hash_blocks(ns, prompt + output, HashKeys("s")) and len(res.block_hashes) == 4
    bad = core.on_encode(EncodeRequest("r2", prompt_token_ids=prompt, resume_output_ids=[5, 10**6]))
    assert isinstance(bad, ErrorReply) and "output token id 1000000" in bad.message


def test_prompt_logprobs_and_cut_logprobs_pass_through(core: TokenizerCore, tok: Tokenizer) -> None:
    # Logprobs stay one per token id, also in the item a stop string ends (its tokens are all of the batch's).
    ids = tok.encode(" one two STOP three", add_special_tokens=False)
    start(core, stop=["STOP"])
    prompt = [None, LogprobWire(5, -1.0)]
    lps = [LogprobWire(t, -0.5) for t in ids]
    a = feed(core, "r1", ids[:2], 0, logprobs=lps[:2], prompt_logprobs=prompt)
    b = feed(core, "r1", ids[2:], 2, logprobs=lps[2:])
    assert a[0].prompt_logprobs == prompt and b[0].prompt_logprobs is None
    assert b[0].stop_string == "STOP" and b[0].logprobs == lps[2:] and b[0].token_ids == ids[2:]
