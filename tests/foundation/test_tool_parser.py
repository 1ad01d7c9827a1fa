"""qwen-code against compose's parsers: a completion in the model's tool-call
format (Qwen3-Coder XML) goes through the parser compose names and comes back
as an OpenAI tool call; <think> goes to reasoning.

The serving layer's own parser object is used (ParserManager.get_parser with
compose's --tool-call-parser / --reasoning-parser and auto tool choice, as
OpenAIServingChat builds it per request), non-streaming (parse) and streaming
(parse_delta, one token per delta from a byte-level tokenizer whose text and
ids agree), with tool_choice auto and required, thinking on and off (qwen-code
sends chat_template_kwargs.enable_thinking=false on its side queries). Every
returned tool call's arguments must parse as JSON and validate against the
tool's schema. What tool_choice "required" does in 0.30.0 with qwen3_coder:
VLLM_ENFORCE_STRICT_TOOL_CALLING (default on) attaches xgrammar's qwen_3_coder
structural tag with at_least_one: the output must open with a
<tool_call><function=NAME> of the tool and typed parameters, and the parser
takes the auto path (supports_required_and_named is False), so a side query
parses. tool_choice auto without a "strict" tool (qwen-code sends none) gets
no grammar at all."""

import json
from pathlib import Path

import pytest
import yaml

import oai_client as oc

REPO = Path(__file__).resolve().parents[2]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<|endoftext|>"]


def compose_flag(name):
    cmd = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["vllm"]["command"]
    return cmd[cmd.index(name) + 1]


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE without merges (one token per byte) plus Qwen's special
    tokens: decode(encode(text)) == text, so streamed deltas carry the same
    text and token ids the detokenizer would give the parser."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, additional_special_tokens=SPECIALS,
                                   eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def parser_cls():
    from vllm.parser import ParserManager

    return ParserManager.get_parser(tool_parser_name=compose_flag("--tool-call-parser"),
                                    reasoning_parser_name=compose_flag("--reasoning-parser"),
                                    enable_auto_tools=True)


READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {
        "absolute_path": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["absolute_path"]}}}
# qwen-code's generateJson side query: the schema becomes the parameters of a
# respond_in_schema tool (here a next-speaker-like schema with every JSON type).
SIDE_SCHEMA = {"type": "object", "properties": {
    "reasoning": {"type": "string"}, "next_speaker": {"type": "string", "enum": ["user", "model"]},
    "suggestions": {"type": "array", "items": {"type": "string"}}, "count": {"type": "integer"},
    "done": {"type": "boolean"}, "meta": {"type": "object", "properties": {"score": {"type": "number"}}}},
    "required": ["reasoning", "next_speaker"]}
RESPOND = {"type": "function", "function": {"name": "respond_in_schema",
                                            "description": "Provide the response in provided schema",
                                            "parameters": SIDE_SCHEMA}}
READ_XML = ("<tool_call>\n<function=read_file>\n<parameter=absolute_path>\n/src/main.py\n"
            "</parameter>\n<parameter=limit>\n200\n</parameter>\n</function>\n</tool_call>")
SIDE_XML = ("<tool_call>\n<function=respond_in_schema>\n<parameter=reasoning>\nThe model asked a "
            "question.\n</parameter>\n<parameter=next_speaker>\nuser\n</parameter>\n"
            "<parameter=suggestions>\n[\"run the tests\", \"commit\"]\n</parameter>\n<parameter=count>\n2\n"
            "</parameter>\n<parameter=done>\nfalse\n</parameter>\n<parameter=meta>\n{\"score\": 0.5}\n"
            "</parameter>\n</function>\n</tool_call>")
SIDE_ARGS = {"reasoning": "The model asked a question.", "next_speaker": "user",
             "suggestions": ["run the tests", "commit"], "count": 2, "done": False, "meta": {"score": 0.5}}


def make_request(tools, tool_choice, thinking, stream=False):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {"model": "qwen3.8-flash-next", "messages": [{"role": "user", "content": "read main.py"}],
            "tools": tools, "stream": stream}
    if tool_choice is not None:  # qwen-code leaves it out on agent turns
        body["tool_choice"] = tool_choice
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return ChatCompletionRequest(**body)


def adjusted(parser_cls, tokenizer, req):
    """As the renderer and OpenAIServingChat do: one parser for adjust_request,
    a fresh one (same chat_template_kwargs) for the output."""
    kw = {"chat_template_kwargs": req.chat_template_kwargs or {}}
    req = parser_cls(tokenizer, req.tools, **kw).adjust_request(req)
    return req, parser_cls(tokenizer, req.tools, **kw)


def stream_parse(parser, req, tokenizer, text, thinking):
    """Feed the output one token per delta, assemble what an OpenAI client sees."""
    prompt = "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    reasoning, content, calls = "", "", {}
    for i, t in enumerate(ids):
        d = parser.parse_delta(tokenizer.decode([t]), [t], req, prompt_token_ids=prompt_ids,
                               finished=i == len(ids) - 1)
        if d is None:
            continue
        reasoning += d.reasoning or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            if tc.function:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
    return reasoning, content, [calls[i] for i in sorted(calls)]


def check_call(call, tools):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call["name"]]
    args = json.loads(call["arguments"])
    assert oc.validate(args, schema) == [], call
    return args


def test_tool_call_parser_extracts_call(tokenizer, parser_cls):
    req, parser = adjusted(parser_cls, tokenizer, make_request([READ_FILE], None, True))
    reasoning, content, calls = parser.parse("<think>\nplan\n</think>\n\nI'll read it.\n" + READ_XML, req,
                                             enable_auto_tools=True)
    assert reasoning.strip() == "plan"
    assert content.strip() == "I'll read it."
    assert len(calls) == 1 and calls[0].name == "read_file"
    assert json.loads(calls[0].arguments) == {"absolute_path": "/src/main.py", "limit": 200}


def test_plain_text_is_not_a_tool_call(tokenizer, parser_cls):
    req, parser = adjusted(parser_cls, tokenizer, make_request([READ_FILE], None, False))
    _, content, calls = parser.parse("No tools needed.", req, enable_auto_tools=True)
    assert not calls and content == "No tools needed."


def test_reasoning_parser_splits_think(tokenizer):
    from vllm.reasoning import ReasoningParserManager

    rp = ReasoningParserManager.get_reasoning_parser(compose_flag("--reasoning-parser"))(tokenizer)
    assert rp.extract_reasoning("<think>plan the edit</think>Done.",
                                make_request([READ_FILE], None, True)) == ("plan the edit", "Done.")


def test_reasoning_field_is_reasoning():
    """Thinking text leaves the server as `reasoning` (reasoning_content is only
    accepted on input messages, renamed)."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage

    assert "reasoning" in ChatMessage.model_fields and "reasoning_content" not in ChatMessage.model_fields
    assert "reasoning" in DeltaMessage.model_fields and "reasoning_content" not in DeltaMessage.model_fields


@pytest.mark.parametrize("tool_choice", [None, "auto", "required"])
@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parse_against_schema(tokenizer, parser_cls, tool_choice, thinking, stream):
    tools = [READ_FILE, RESPOND]
    req, parser = adjusted(parser_cls, tokenizer, make_request(tools, tool_choice, thinking, stream))
    # required: the grammar makes the call the first thing after reasoning
    lead = "" if tool_choice == "required" else "Checking.\n"
    text = ("<think>\nwho speaks next\n</think>\n\n" if thinking else "") + lead + SIDE_XML
    if stream:
        reasoning, content, calls = stream_parse(parser, req, tokenizer, text, thinking)
    else:
        reasoning, content, fcs = parser.parse(text, req, enable_auto_tools=True)
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in fcs]
    assert len(calls) == 1 and calls[0]["name"] == "respond_in_schema"
    assert check_call(calls[0], tools) == SIDE_ARGS
    assert "<tool_call>" not in (content or "") and "<function=" not in (content or "")
    assert (reasoning or "").strip() == ("who speaks next" if thinking else "")


def test_two_calls_streamed(tokenizer, parser_cls):
    tools = [READ_FILE, RESPOND]
    req, parser = adjusted(parser_cls, tokenizer, make_request(tools, None, True, stream=True))
    _, _, calls = stream_parse(parser, req, tokenizer, "<think>\nx\n</think>\n\n" + READ_XML + "\n" + SIDE_XML,
                               True)
    assert [c["name"] for c in calls] == ["read_file", "respond_in_schema"]
    assert all(c["id"] for c in calls) and len({c["id"] for c in calls}) == 2
    assert [check_call(c, tools) for c in calls][1] == SIDE_ARGS


def test_auto_without_strict_has_no_grammar(tokenizer, parser_cls):
    """qwen-code's agent turns (tools, tool_choice left out -> auto, no
    "strict") are not grammar-constrained in 0.30.0; a strict tool would be."""
    req, _ = adjusted(parser_cls, tokenizer, make_request([READ_FILE], None, True))
    assert req.tool_choice == "auto" and req.structured_outputs is None
    strict = json.loads(json.dumps(READ_FILE))
    strict["function"]["strict"] = True
    req, _ = adjusted(parser_cls, tokenizer, make_request([strict], None, True))
    tag = json.loads(req.structured_outputs.structural_tag)
    assert tag["format"]["type"] == "triggered_tags" and tag["format"]["at_least_one"] is False


def test_required_forces_a_typed_call(tokenizer, parser_cls):
    """tool_choice required -> xgrammar's qwen_3_coder structural tag, at least
    one call; it accepts the model's XML and rejects what would not parse."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from vllm.tool_parsers import ToolParserManager

    assert ToolParserManager.get_tool_parser(compose_flag("--tool-call-parser")).supports_required_and_named \
        is False  # so "required" is parsed like auto (the XML), not as a JSON list
    req, _ = adjusted(parser_cls, tokenizer, make_request([RESPOND], "required", False))
    assert req.response_format is None
    tag = json.loads(req.structured_outputs.structural_tag)
    assert tag["format"]["at_least_one"] is True
    assert tag["format"]["tags"][0]["begin"] == "<tool_call>\n<function=respond_in_schema>\n"
    grammar = xgr.Grammar.from_structural_tag(req.structured_outputs.structural_tag)
    assert accepts(grammar, SIDE_XML)
    assert not accepts(grammar, "The user should speak next.")  # no call
    assert not accepts(grammar, "Sure.\n" + SIDE_XML)  # text before the call
    assert not accepts(grammar, '{"reasoning": "x", "next_speaker": "user"}')  # JSON, not XML
    assert not accepts(grammar, SIDE_XML.replace("\nuser\n", "\nme\n"))  # enum
    assert not accepts(grammar, SIDE_XML.replace("\n2\n", "\ntwo\n"))  # integer
