"""Tool calling through a chat template that renders tools itself (the Hermes convention:
tests/data/hermes_tools_template.jinja) on SmolLM2's weights: the gateway gives the template the tools and the
earlier calls as structured values and sends the rendered ids, equal to transformers' rendering of the same
conversation; a forced choice's grammar makes greedy decoding give `<tool_call>` blocks, token for token what
transformers gives under the same mask, read back as the OpenAI tool calls asked for (whole and streamed)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from deepinfer.engine.request import SamplingParams
from deepinfer.gateway.openai_requests import ParseContext, parse_chat
from deepinfer.gateway.openai_responses import ChoiceStream, chat_choice
from deepinfer.gateway.text_work import TextWork
from deepinfer.gateway.tool_formats import HERMES_TAGS, JSON_CONVENTION, tool_format_for
from deepinfer.grammar import Constraint, ConstraintSpec, GrammarCache, apply_bitmask_, grammar_vocab, new_bitmask
from deepinfer.protocol import messages as m
from deepinfer.protocol.client_requests import constraint_of
from deepinfer.text.tokenizer import Tokenizer
from tests.engine.oracle import hf_logits
from tests.engine.test_structured_smollm2 import engine, run

pytestmark = pytest.mark.smollm2

TEMPLATE = (Path(__file__).parent.parent / "data" / "hermes_tools_template.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def case(smollm2_oracle):  # type: ignore[no-untyped-def]
    o = smollm2_oracle
    tok = Tokenizer(o.tok.backend, chat_template=TEMPLATE, bos_token=o.tok.bos_token, eos_token=o.tok.eos_token)
    text = TextWork(tok, 8192)
    ctx = ParseContext("smollm2", 8192, lambda msgs: len(text.encode_chat(msgs)),
                       tool_format=tool_format_for(TEMPLATE),
                       render_chat=lambda msgs, tools: text.encode_chat(msgs, tools=tools))
    return o, tok, ctx


def transformers_ids(tok: Tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:  # type: ignore[type-arg]
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    return list(hf.apply_chat_template(messages, tools=tools, chat_template=TEMPLATE, tokenize=True,
                                       add_generation_prompt=True, return_dict=False))


def masked_greedy_agrees(o, prompt: list[int], spec: ConstraintSpec, out: list[int]) -> bool:  # type: ignore[no-untyped-def]
    """Whether `out` is transformers' greedy continuation under the constraint's mask: at every position the
    masked argmax of transformers' logits (one forward over prompt and output) is the token `out` has there."""
    vocab = o.hf.config.vocab_size
    constraint = Constraint(GrammarCache(grammar_vocab(o.tok, n_vocab=vocab)).compile(spec))
    logits = hf_logits(o.hf, [*prompt, *out[:-1]])[len(prompt) - 1:].float()
    for row, token in zip(logits, out, strict=True):
        mask = new_bitmask(1, vocab)
        constraint.allowed_mask(mask[0])
        masked = row[None].clone()
        apply_bitmask_(masked, mask, [0])
        if int(torch.argmax(masked, dim=-1)) != token or not constraint.accept(token):
            return False
    return constraint.is_finished


def test_the_template_gets_the_tools_and_the_earlier_calls_as_transformers_renders_them(case) -> None:  # type: ignore[no-untyped-def]
    o, tok, ctx = case
    assert tool_format_for(TEMPLATE) is HERMES_TAGS and tool_format_for(o.tok.chat_template) is JSON_CONVENTION
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    plan = parse_chat({"model": "smollm2", "messages": history, "tools": [WEATHER, TIME]}, ctx)
    [req] = plan.requests
    assert req.messages is None and "json_schema" not in req.params and "grammar" not in req.params  # auto: free
    structured = [*history[:2], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"}]
    assert req.prompt_token_ids == transformers_ids(tok, structured, [WEATHER, TIME])
    text = tok.decode(req.prompt_token_ids)
    assert "<tools>" in text and '"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "You can call these tools" not in text  # the template's description, not the JSON convention's
    # A chat without tools goes to the mesh as messages (the mesh's tokenizer renders the same template).
    assert parse_chat({"model": "smollm2", "messages": ASK}, ctx).requests[0].messages == ASK


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_choice_answers_with_tool_call_blocks_exactly_as_transformers_does(case, choice) -> None:  # type: ignore[no-untyped-def]
    o, tok, ctx = case
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    body = {"model": "smollm2", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
            "max_tokens": MAX_TOKENS}
    plan = parse_chat(body, ctx)
    [req] = plan.requests
    params = dict(req.params)
    wire = constraint_of(params)
    assert wire is not None and wire.kind == "grammar" and "<tool_call>" in wire.text
    spec = ConstraintSpec(wire.kind, wire.text, wire.strict)
    prompt = list(req.prompt_token_ids or [])
    out = run(engine(o), prompt, SamplingParams(max_tokens=MAX_TOKENS, constraint=spec))
    assert masked_greedy_agrees(o, prompt, spec, list(out.token_ids))
    swapped = list(out.token_ids)
    swapped[3] = swapped[4]  # the check can fail: another token where greedy put its own
    assert not masked_greedy_agrees(o, prompt, spec, swapped)
    assert out.text.startswith("<tool_call>\n{") and out.text.rstrip().endswith("</tool_call>")
    fin = m.RequestFinished("r", out.text, out.token_ids, "stop", m.UsageWire(len(prompt), len(out.token_ids)),
                            m.Timings(0.1))
    answer = chat_choice(plan, 0, fin, lambda t: tok.decode([t]))
    assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
    calls = answer["message"]["tool_calls"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])
    if choice == "named":
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    # Streamed token by token: nothing goes out as content, and the calls assemble to the same ones.
    stream = ChoiceStream(plan, "id", 0, 0, lambda t: tok.decode([t]), tok.decode)
    chunks = [c for i, t in enumerate(out.token_ids)
              for c in stream.on_delta(m.StreamDelta("r", tok.decode([t]), [t]))]
    assert all(not c["choices"][0]["delta"].get("content") for c in chunks)
    end = stream.on_finished(fin)
    streamed = [d["tool_calls"][0]["function"] for c in end if "tool_calls" in (d := c["choices"][0]["delta"])]
    assert streamed == [c["function"] for c in calls] and end[-1]["choices"][0]["finish_reason"] == "tool_calls"
